// The main of the MPI test binaries (see mpi_testing.h).
#include <gtest/gtest.h>

#include <cstdio>
#include <span>

#include "dist/mpi_testing.h"

using namespace flashlm;

namespace {

Communicator* g_world = nullptr;

// Rank > 0: only failures, prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.message());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

Communicator& test_world() { return *g_world; }

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  bool failed = false;
  {
    Communicator world;
    g_world = &world;
    if (world.rank() > 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(world.rank()));
    }
    const int local = RUN_ALL_TESTS();
    // Every rank exits non-zero when any rank failed.
    double f = local != 0 ? 1.0 : 0.0;
    world.all_reduce(std::span<double>(&f, 1), ReduceOp::max);
    failed = f > 0;
    if (failed && world.rank() == 0 && local == 0) std::fprintf(stderr, "rank 0 passed, but another rank failed\n");
    g_world = nullptr;
  }
  Communicator::finalize();
  return failed ? 1 : 0;
}
