// flashlm::Error: the one exception type every public entry point throws on bad input or a failed
// runtime call. Its message names the function, the argument and what was expected.
#pragma once
#include <stdexcept>
#include <string>

namespace flashlm {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller's input is wrong: an argument, an option or a configuration value (a model size, a name to
// parse, a combination of settings), not a file's contents or a failed runtime call. The CLI reports it as a
// usage error (exit 2), every other Error as a runtime error (exit 1).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A request for more memory than the device (or host) can give. Benchmarks record it as `oom` and go on.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A CUDA runtime call or kernel launch failed (not the caller's arguments).
class CudaError : public Error {
 public:
  using Error::Error;
};

}  // namespace flashlm
