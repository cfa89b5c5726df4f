// flashlm: the command-line tool. Each subcommand (tools/cmd_*.cpp, text_commands.cpp) binds its options to
// the library's configuration, calls the library and prints.
// Exit codes: 0 success, 2 usage error (a CLI11 parse error or a flashlm::InvalidArgument), 1 runtime error.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <vector>

#include "flashlm/blas.h"
#include "flashlm/device.h"
#include "cli_common.h"
#include "text_commands.h"

int main(int argc, char** argv) {
  flashlm::restart_with_cpu_settings(argv);
  CLI::App app{"flashlm: FlashAttention-2, a Transformer LM and data-parallel training, with the tools to measure them"};
  app.require_subcommand(1);
  app.set_version_flag("--version", FLASHLM_VERSION);
  const std::vector<Command> commands{add_attention_bench_command(app), add_train_command(app), add_bench_command(app),
                                      add_allreduce_bench_command(app), add_ddp_bench_command(app)};
  add_info_command(app);
  TextCommandArgs text_args;
  add_text_commands(app, text_args);

  flashlm::set_report_command_line(argc, argv);
  try {
    refuse_torchrun();
    app.parse(argc, argv);
    flashlm::check_environment();  // a bad FLASHLM_* setting is a usage error before any work
    for (const Command& c : commands) {
      if (c.app->parsed()) return c.run();
    }
    if (const int rc = run_text_command(app, text_args); rc >= 0) return rc;
    return 0;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "error: {}\nRun with --help for usage.\n", e.what());
    return 2;
  } catch (const flashlm::InvalidArgument& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
