// flashlm info: the build and the devices flashlm sees.
#include "cli_common.h"
#include "flashlm/blas.h"
#include "flashlm/device.h"

void add_info_command(CLI::App& app) {
  app.add_subcommand("info", "Print the build and the devices flashlm sees")->callback([] {
    fmt::print("flashlm {}\n", FLASHLM_VERSION);
    fmt::print("cpu:  {}, {} OpenMP threads\n", flashlm::describe_device(flashlm::Device::cpu), flashlm::cpu_threads());
    fmt::print("cpu attention kernels: {}\n", flashlm::cpu_attention_kernels());
    fmt::print("blas: {}\n", flashlm::blas_description());
    if (!flashlm::cuda_built()) fmt::print("cuda: not built (nvcc was not found at configure time)\n");
    else if (flashlm::cuda_device_count() == 0) fmt::print("cuda: built, no device visible\n");
    else fmt::print("cuda: {} device(s); current: {}\n", flashlm::cuda_device_count(),
                    flashlm::describe_device(flashlm::Device::cuda));
  });
}
