#include "core/gemm_sm_reserve.h"

#include "core/check.h"

namespace flashlm {

namespace {
thread_local int t_sm_reserve = 0;  // per host thread, like the stream a caller uses
}  // namespace

void set_gemm_sm_reserve(int sms) {
  FLASHLM_CHECK(sms >= 0, "set_gemm_sm_reserve: {} SMs, expected >= 0", sms);
  t_sm_reserve = sms;
}

int gemm_sm_reserve() { return t_sm_reserve; }

}  // namespace flashlm
