// flashlm's BPE goes through scripts/prepare_data.py (the `tokenizers` package trains and encodes it; see
// that script for why): this runs it as a child process, with no shell in between.
#pragma once
#include <string>
#include <vector>

// Runs `$FLASHLM_PYTHON scripts/prepare_data.py args...` (python3 from PATH when FLASHLM_PYTHON is unset; the
// script from this source tree, or FLASHLM_PREPARE_DATA_SCRIPT) and returns what it printed on stdout. A
// script that cannot start, or exits non-zero, is a flashlm::Error carrying the script's own message; one
// still running after timeout_s seconds (FLASHLM_PREPARE_DATA_TIMEOUT, when set, replaces it) is killed, and
// an Error saying so.
std::string run_prepare_data_script(const std::vector<std::string>& args, double timeout_s);
