# Ranks started with different settings (mpirun's MPMD form: `-np 1 flashlm A : -np 1 flashlm B`): train and
# ddp-bench fail at the start, every rank printing which setting differs, and exit 2 (a usage error);
# settings that may differ per rank (threads, logging, evaluation, which only rank 0 does) are accepted.
# Arguments: FLASHLM, MPIRUN, MPIRUN_FLAGS (a list).
set(tiny --device cpu --model tiny --vocab 64 --context 16 --batch 2 --steps 3 --ddp bucketed --bucket-mb 0.01)
set(bench --device cpu --model tiny --vocab 64 --context 16 --batch 2 --ddp flat --warmup 0 --steps 1 --quiet)

# run(<name> <expected exit> ARGS0 <rank 0's arguments> ARGS1 <rank 1's arguments>): sets `out`.
function(run name expected_rc)
  cmake_parse_arguments(PARSE_ARGV 2 R "" "" "ARGS0;ARGS1")
  execute_process(COMMAND ${MPIRUN} ${MPIRUN_FLAGS} -np 1 ${FLASHLM} ${R_ARGS0} : -np 1 ${FLASHLM} ${R_ARGS1}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc STREQUAL "${expected_rc}")
    message(FATAL_ERROR "${name}: mpirun exit '${rc}', expected ${expected_rc}\nstdout: ${out}\nstderr: ${err}")
  endif()
  set(out "${out}${err}" PARENT_SCOPE)
endfunction()

# <what>|<option>|<rank 0's value>|<rank 1's value>|<the setting named, as the message spells it>
foreach(case "train|--steps|3|4|steps \\(rank 0: 3, rank 1: 4\\)"
             "train|--zero|0|1|zero1 \\(rank 0: false, rank 1: true\\)"
             "train|--batch|2|3|batch \\(rank 0: 2, rank 1: 3\\)"
             "train|--context|16|8|model.context \\(rank 0: 16, rank 1: 8\\), seq \\(rank 0: 16, rank 1: 8\\)"
             "train|--lr|0.003|0.001|optimizer.lr_max \\(rank 0: 0.003, rank 1: 0.001\\)"
             "train|--seed|1|2|seed \\(rank 0: 1, rank 1: 2\\)"
             "ddp-bench|--batch|2|3|batch \\(rank 0: 2, rank 1: 3\\)"
             "ddp-bench|--zero|0|0,1|zero1 \\(rank 0: 0, rank 1: 0,1\\)")
  string(REPLACE "|" ";" c "${case}")
  list(GET c 0 command)
  list(GET c 1 option)
  list(GET c 2 v0)
  list(GET c 3 v1)
  list(GET c 4 field)
  set(common ${tiny})
  if(command STREQUAL "ddp-bench")
    set(common ${bench})
  endif()
  list(FIND common ${option} at)  # the case's option replaces the common one
  if(at GREATER_EQUAL 0)
    list(REMOVE_AT common ${at})
    list(REMOVE_AT common ${at})
  endif()
  run("${command} ${option} ${v0} / ${v1}" 2 ARGS0 ${command} ${common} ${option} ${v0}
      ARGS1 ${command} ${common} ${option} ${v1})
  set(line "error: rank 1's run configuration differs from rank 0's in ${field}")
  string(REGEX MATCHALL "${line}" lines "${out}")
  list(LENGTH lines n)
  if(NOT n EQUAL 2)  # one line from each rank
    message(FATAL_ERROR "${command} ${option} ${v0} / ${v1}: expected '${line}' from both ranks:\n${out}")
  endif()
  if(out MATCHES "step +1/")
    message(FATAL_ERROR "${command} ${option} ${v0} / ${v1}: trained although the ranks disagree:\n${out}")
  endif()
  message(STATUS "${command} ${option} ${v0} / ${v1}: exit 2, named")
endforeach()

# Rank-local settings may differ.
run("rank-local settings" 0 ARGS0 train ${tiny} --threads 1 --log-every 1 --eval-every 0 --eval-batches 1
    ARGS1 train ${tiny} --threads 2 --log-every 2 --eval-every 1 --eval-batches 2)
if(NOT out MATCHES "step +3/3 \\| loss")
  message(FATAL_ERROR "rank-local settings: rank 0 did not train to the end:\n${out}")
endif()
