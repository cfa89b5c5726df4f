# What the CLI scripts that drive ${FLASHLM} as a user types it share (include()d; FLASHLM is the binary).
# run_ok(what ARGS...): flashlm ARGS must exit 0; leaves `out` and `err` in the caller's scope.
# expect_exit(code pattern ARGS...): flashlm ARGS must exit `code` with stderr starting "error: " and
# matching pattern.
function(run_ok what)
  execute_process(COMMAND ${FLASHLM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what}: exit ${rc}\nstdout: ${out}\nstderr: ${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

function(expect_exit code pattern)
  execute_process(COMMAND ${FLASHLM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  if(NOT rc EQUAL code OR NOT err MATCHES "^error: .*${pattern}")
    message(FATAL_ERROR "flashlm ${ARGN}: exit ${rc}, expected ${code} and 'error: ...${pattern}'\nstderr: ${err}")
  endif()
endfunction()
