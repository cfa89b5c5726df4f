# A test that fails on one rank only: mpirun must exit non-zero and the failing rank must say which test
# failed, whichever rank it is. Arguments: MPIRUN, MPIRUN_FLAGS (a list), TEST_DIST.
foreach(rank 0 1)
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env FLASHLM_TEST_FAIL_ON_RANK=${rank}
            ${MPIRUN} ${MPIRUN_FLAGS} -np 2 ${TEST_DIST} --gtest_filter=FailurePropagation.*
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  set(all "${out}${err}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "failure injected on rank ${rank}, but mpirun exited 0:\n${all}")
  endif()
  if(rank EQUAL 0)
    set(expected "FAILED.*FailurePropagation.InjectedFailure")
  else()
    set(expected "\\[rank 1\\] FAILED FailurePropagation.InjectedFailure")
  endif()
  if(NOT all MATCHES "${expected}" OR NOT all MATCHES "injected failure on rank ${rank}")
    message(FATAL_ERROR "failure injected on rank ${rank}: output lacks '${expected}' (exit ${rc}):\n${all}")
  endif()
  message(STATUS "failure on rank ${rank}: mpirun exit ${rc}")
endforeach()
