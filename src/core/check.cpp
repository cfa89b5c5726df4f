#include "core/check.h"

namespace flashlm {

size_t checked_size(std::initializer_list<int64_t> factors, std::string_view what) {
  return static_cast<size_t>(checked_product(factors, what));
}

}  // namespace flashlm

namespace flashlm::detail {

std::string format_braces(std::string_view format, std::initializer_list<std::string> args) {
  std::string out;
  auto next = args.begin();
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] == '{' && i + 1 < format.size() && format[i + 1] == '}' && next != args.end()) {
      out += *next++;
      ++i;
    } else {
      out += format[i];
    }
  }
  return out;
}

}  // namespace flashlm::detail
