# What the CLI scripts that drive ${FLASHLM} as a user types it share (include()d; FLASHLM is the binary).
# run_command_ok(what COMMAND...): the command (e.g. mpirun ... flashlm ...) must exit 0; leaves `out` and
# `err` in the caller's scope.
# run_ok(what ARGS...): the same for flashlm ARGS.
# expect_exit(code pattern ARGS...): flashlm ARGS must exit `code` with stderr starting "error: " and
# matching pattern.
function(run_command_ok what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what}: exit ${rc}\nstdout: ${out}\nstderr: ${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

macro(run_ok what)  # a macro, so that run_command_ok's `out` and `err` land in the caller's scope
  run_command_ok("${what}" ${FLASHLM} ${ARGN})
endmacro()

function(expect_exit code pattern)
  execute_process(COMMAND ${FLASHLM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  if(NOT rc EQUAL code OR NOT err MATCHES "^error: .*${pattern}")
    message(FATAL_ERROR "flashlm ${ARGN}: exit ${rc}, expected ${code} and 'error: ...${pattern}'\nstderr: ${err}")
  endif()
endfunction()
