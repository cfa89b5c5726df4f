# The CPU mpirun examples of docs/usage.md (the README's long form), as written except for what a 2-core CI
# machine running as root must add (the document says so beside them: MPIRUN_FLAGS, --allow-run-as-root
# --oversubscribe) and shorter runs (--steps 300 -> 3, the 1 GB all-reduce -> 1 MB): every option they use must
# still exist and work. Arguments: README, FLASHLM, MPIRUN, MPIRUN_FLAGS, WORKDIR.
file(STRINGS ${README} lines REGEX "^mpirun ")
set(dir ${WORKDIR}/readme_mpirun)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(ran 0)
foreach(line IN LISTS lines)
  if(line MATCHES "--device cuda")
    continue()  # GPU examples run on the GPU machine (scripts/gpu-check.sh)
  endif()
  string(REGEX REPLACE " +#.*$" "" line "${line}")
  string(REPLACE "--steps 300" "--steps 3" line "${line}")
  string(REPLACE "--sizes 1MB,10MB,100MB,1GB" "--sizes 1MB" line "${line}")
  string(REPLACE "build/tools/flashlm" "${FLASHLM}" line "${line}")
  separate_arguments(args UNIX_COMMAND "${line}")
  list(POP_FRONT args)  # mpirun
  execute_process(COMMAND ${MPIRUN} ${MPIRUN_FLAGS} ${args} WORKING_DIRECTORY ${dir} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "README example '${line}': exit ${rc}\nstdout: ${out}\nstderr: ${err}")
  endif()
  math(EXPR ran "${ran} + 1")
endforeach()
if(ran LESS 3)
  message(FATAL_ERROR "found ${ran} CPU mpirun examples in ${README}, expected at least 3")
endif()
message(STATUS "${ran} README mpirun examples ran")
