# A rank that exits in the middle of an FSDP step (FsdpFailure.RankDiesMidStep): its peer is left waiting in a
# collective, and mpirun must end the job non-zero well within the timeout, whichever rank died.
# Arguments: MPIRUN, MPIRUN_FLAGS (a list), TEST_FSDP.
foreach(rank 0 1)
  string(TIMESTAMP t0 "%s")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env FLASHLM_TEST_DIE_ON_RANK=${rank}
            ${MPIRUN} ${MPIRUN_FLAGS} -np 2 ${TEST_FSDP} --gtest_filter=FsdpFailure.*
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  string(TIMESTAMP t1 "%s")
  math(EXPR seconds "${t1} - ${t0}")
  set(all "${out}${err}")
  # rc is a message, not a number, when the timeout killed mpirun.
  if(NOT rc MATCHES "^[0-9]+$")
    message(FATAL_ERROR "rank ${rank} died mid-step, and the job did not end by itself (${rc}) after ${seconds} s:\n${all}")
  endif()
  if(rc EQUAL 0)
    message(FATAL_ERROR "rank ${rank} died mid-step, but mpirun exited 0:\n${all}")
  endif()
  if(all MATCHES "finished a step its peer died in")
    message(FATAL_ERROR "rank ${rank} died mid-step, but its peer went on:\n${all}")
  endif()
  message(STATUS "rank ${rank} died mid-step: mpirun exit ${rc} after ${seconds} s")
endforeach()
