# flashlm allreduce-bench under mpirun: the table comes once (rank 0), with one row per size for the
# right world size; JSON has every field; bad arguments are usage errors on every rank.
# Arguments: FLASHLM, MPIRUN, MPIRUN_FLAGS (a list), WORKDIR.
set(mpi2 ${MPIRUN} ${MPIRUN_FLAGS} -np 2)

execute_process(COMMAND ${mpi2} ${FLASHLM} allreduce-bench --sizes 1MB,4MB --iters 2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "allreduce-bench under mpirun -np 2: exit ${rc}\nstdout: ${out}\nstderr: ${err}")
endif()
string(REGEX MATCHALL "\\| *backend *\\| *ranks *\\|" headers "${out}")
list(LENGTH headers n_headers)
string(REGEX MATCHALL "\\| *mpi *\\| *2 *\\| *fp32 *\\| *[14] MB *\\|[^\n]*\\| *ok *\\|" rows "${out}")
list(LENGTH rows n_rows)
if(NOT n_headers EQUAL 1 OR NOT n_rows EQUAL 2)
  message(FATAL_ERROR "expected one table (rank 0) with two ok rows for 2 ranks, got ${n_headers} header(s), "
                      "${n_rows} row(s):\n${out}")
endif()
if(NOT err MATCHES "allreduce-bench: 2 rank\\(s\\)" OR NOT err MATCHES "\\[2/2\\] all-reduce 4 MB")
  message(FATAL_ERROR "progress lines missing on stderr:\n${err}")
endif()

set(json_file ${WORKDIR}/allreduce_bench.json)
file(REMOVE ${json_file})
execute_process(COMMAND ${mpi2} ${FLASHLM} allreduce-bench --sizes 64KiB,1MB,2 --dtype fp32,fp64 --iters 2
                        --warmup 1 --format json --out ${json_file} --quiet
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT EXISTS ${json_file})
  message(FATAL_ERROR "json run: exit ${rc}\nstdout: ${out}\nstderr: ${err}")
endif()
file(READ ${json_file} json)
string(JSON n LENGTH "${json}" records)
string(JSON world GET "${json}" world_size)
if(NOT n EQUAL 6 OR NOT world EQUAL 2)
  message(FATAL_ERROR "json: ${n} records (expected 6), world_size ${world} (expected 2):\n${json}")
endif()
foreach(field op backend world_size dtype size bytes elements median_ms mean_ms min_ms algbw_gbps busbw_gbps status)
  string(JSON value ERROR_VARIABLE missing GET "${json}" records 0 ${field})
  if(missing)
    message(FATAL_ERROR "json record lacks '${field}': ${missing}")
  endif()
endforeach()
string(JSON bytes GET "${json}" records 0 bytes)
string(JSON status0 GET "${json}" records 0 status)
string(JSON status2 GET "${json}" records 2 status)  # 2 bytes: less than one fp32 element
if(NOT bytes EQUAL 65536 OR NOT status0 STREQUAL "ok" OR NOT status2 STREQUAL "error")
  message(FATAL_ERROR "json: bytes ${bytes}, statuses ${status0} ${status2}:\n${json}")
endif()

# Usage errors: exit 2 with "error: ..." without mpirun; under mpirun every rank fails and so does mpirun.
foreach(bad "--sizes;12XB" "--dtype;bf16")
  execute_process(COMMAND ${FLASHLM} allreduce-bench ${bad} RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "^error: ")
    message(FATAL_ERROR "allreduce-bench ${bad}: exit ${rc}, expected 2 with 'error: '\nstderr: ${err}")
  endif()
  execute_process(COMMAND ${mpi2} ${FLASHLM} allreduce-bench ${bad} RESULT_VARIABLE rc ERROR_VARIABLE err
                  TIMEOUT 120)
  if(rc EQUAL 0 OR NOT err MATCHES "error: ")
    message(FATAL_ERROR "mpirun allreduce-bench ${bad}: exit ${rc}, expected non-zero\nstderr: ${err}")
  endif()
endforeach()
