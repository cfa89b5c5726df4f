# The collective timeout: a rank that stalls (CollectiveTimeout.StalledRank sleeps on rank R) while its peer
# waits in an all-reduce ends the job within seconds, with an error from the waiting rank that names it
# and the operation; without the watchdog this would wait until TIMEOUT. Arguments: FLASHLM, MPIRUN,
# MPIRUN_FLAGS (a list), TEST_DIST.
foreach(stalled 1 0)
  math(EXPR waiting "1 - ${stalled}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env FLASHLM_TEST_STALL_RANK=${stalled}
            ${MPIRUN} ${MPIRUN_FLAGS} -np 2 ${TEST_DIST} --gtest_filter=CollectiveTimeout.StalledRank
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  set(all "${out}${err}")
  if(rc EQUAL 0 OR rc MATCHES "timeout")
    message(FATAL_ERROR "rank ${stalled} stalled: mpirun exit '${rc}', expected the job ended with an error:\n${all}")
  endif()
  set(expected "error: rank ${waiting}: MPI_Allreduce \\(collective call [0-9]+ of this rank\\) did not finish within 1 s")
  if(NOT all MATCHES "${expected}" OR NOT all MATCHES "ending the job")
    message(FATAL_ERROR "rank ${stalled} stalled: output lacks '${expected}' (exit ${rc}):\n${all}")
  endif()
  if(all MATCHES "the all-reduce returned")
    message(FATAL_ERROR "rank ${stalled} stalled: a rank went on past the all-reduce:\n${all}")
  endif()
  message(STATUS "rank ${stalled} stalled: mpirun exit ${rc}")
endforeach()

# Through the CLI: rank 0 evaluates alone for far longer than --collective-timeout-s 1 while rank 1 waits
# for it in the next step's gradient all-reduce; rank 1 ends the job, naming itself and the wait.
set(train ${FLASHLM} train --device cpu --model tiny --vocab 64 --context 16 --batch 2 --steps 3 --ddp bucketed
          --collective-timeout-s 1)
execute_process(COMMAND ${MPIRUN} ${MPIRUN_FLAGS} -np 1 ${train} --eval-every 1 --eval-batches 1000000
                        : -np 1 ${train}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
set(all "${out}${err}")
set(expected "error: rank 1: MPI_[A-Za-z]+ \\(collective call [0-9]+ of this rank\\) did not finish within 1 s")
if(rc EQUAL 0 OR rc MATCHES "timeout" OR NOT all MATCHES "${expected}")
  message(FATAL_ERROR "train, rank 0 evaluating past the timeout: exit '${rc}', expected '${expected}':\n${all}")
endif()
message(STATUS "train, rank 0 evaluating past the timeout: mpirun exit ${rc}")
# The option is bounded: a usage error otherwise.
foreach(bad -1 nan inf 1e9 x)
  execute_process(COMMAND ${FLASHLM} train --collective-timeout-s ${bad} RESULT_VARIABLE rc ERROR_VARIABLE err
                  TIMEOUT 60)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "error: --collective-timeout-s: '${bad}' is not a number in \\[0, 604800\\]")
    message(FATAL_ERROR "train --collective-timeout-s ${bad}: exit ${rc}\nstderr: ${err}")
  endif()
endforeach()
