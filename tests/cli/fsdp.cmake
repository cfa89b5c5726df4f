# flashlm train --ddp fsdp and ddp-bench --ddp fsdp under mpirun -np 2 on the CPU: FSDP training with
# evaluation on rank 0 (the parts gathered for it) resumes bit-exactly at the same world size, and its
# gathered checkpoint continues in one process with the same global batch; ddp-bench gives the fsdp row
# with its memory per rank beside bucketed DDP's; bad FSDP options are usage errors.
# Arguments: FLASHLM, MPIRUN, MPIRUN_FLAGS (a list), WORKDIR.
cmake_policy(SET CMP0054 NEW)  # quoted arguments of if() are strings, never variables
set(mpi2 ${MPIRUN} ${MPIRUN_FLAGS} -np 2)
set(common --device cpu --model tiny --vocab 64 --context 16 --eval-every 2 --eval-batches 1 --grad-accum 2
           --cosine-steps 6 --log-every 1)
set(fsdp_args ${common} --batch 2 --ddp fsdp --fsdp-prefetch 2)

include(${CMAKE_CURRENT_LIST_DIR}/flashlm_commands.cmake)

# The loss of step 6 in a run's output, in units of 1e-4.
function(last_loss var text)
  if(NOT text MATCHES "step +6/6 \\| loss ([0-9]+)\\.([0-9][0-9][0-9][0-9])")
    message(FATAL_ERROR "no loss for step 6 in:\n${text}")
  endif()
  math(EXPR value "${CMAKE_MATCH_1} * 10000 + 1${CMAKE_MATCH_2} - 10000")
  set(${var} ${value} PARENT_SCOPE)
endfunction()

set(full ${WORKDIR}/fsdp_full.ckpt)
set(half ${WORKDIR}/fsdp_half.ckpt)
set(moved ${WORKDIR}/fsdp_moved.ckpt)
file(REMOVE ${full} ${half} ${moved})
run_command_ok("fsdp 6 steps" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 6 --checkpoint ${full})
if(NOT out MATCHES "DDP fsdp \\([0-9]+ fp32 reduce-scatter\\(s\\) per step, 4 parts gathered, prefetch 2\\); FSDP keeps [0-9.]+ MiB of parameters, [0-9.]+ of gradients and [0-9.]+ of AdamW state per rank"
   OR NOT out MATCHES "step +6/6 \\| val loss [0-9]")
  message(FATAL_ERROR "expected the FSDP data-parallel line and rank 0's evaluation:\n${out}")
endif()
last_loss(loss_full "${out}")
# --precision fp8 (emulated): the two layers are gathered as FP8 bytes (evaluation on rank 0 too), and the
# data-parallel line says so.
run_command_ok("fsdp fp8" ${mpi2} ${FLASHLM} train ${fsdp_args} --precision fp8 --steps 2)
if(NOT out MATCHES "4 parts gathered \\(2 as FP8 bytes\\), prefetch 2" OR NOT out MATCHES "step +2/2 \\| val loss [0-9]")
  message(FATAL_ERROR "expected FSDP to gather the layers as FP8 bytes:\n${out}")
endif()
run_command_ok("fsdp 3 steps" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 3 --checkpoint ${half})
file(COPY_FILE ${half} ${moved})
run_command_ok("fsdp resume to 6" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 6 --checkpoint ${half} --resume)
file(SHA256 ${full} full_hash)
file(SHA256 ${half} half_hash)
if(NOT full_hash STREQUAL half_hash)
  message(FATAL_ERROR "6 steps and 3 + resume + 3 under FSDP wrote different checkpoints")
endif()
# The gathered checkpoint of 2 ranks x 2 sequences, continued by one process with 4 sequences (and FSDP's
# world of one): the same data, the same training up to the order of sums.
run_command_ok("resume in one process" ${FLASHLM} train ${common} --batch 4 --steps 6 --checkpoint ${moved} --resume)
last_loss(loss_moved "${out}")
math(EXPR gap "${loss_full} - ${loss_moved}")
if(gap GREATER 2 OR gap LESS -2)
  message(FATAL_ERROR "step 6's loss: ${loss_full} (2 ranks) and ${loss_moved} (resumed in one process), x 1e-4")
endif()
# Another global batch reads other data: refused (the one-process run rewrote the checkpoint with batch 4).
execute_process(COMMAND ${FLASHLM} train ${common} --batch 2 --steps 7 --checkpoint ${moved} --resume
                RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 1 OR NOT err MATCHES "differs from this run in batch: the checkpoint has 4, this run 2")
  message(FATAL_ERROR "resume with another global batch: exit ${rc}\nstderr: ${err}")
endif()

# Sharded checkpoints: every rank writes its own file, and 3 + resume + 3 steps write the same files as 6.
set(sfull ${WORKDIR}/fsdp_sharded_full.ckpt)
set(shalf ${WORKDIR}/fsdp_sharded_half.ckpt)
file(REMOVE ${sfull}.rank0-of-2 ${sfull}.rank1-of-2 ${shalf}.rank0-of-2 ${shalf}.rank1-of-2)
run_command_ok("fsdp sharded 6 steps" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 6 --checkpoint ${sfull} --sharded-checkpoint)
last_loss(loss_sharded "${out}")
if(NOT loss_sharded EQUAL loss_full)
  message(FATAL_ERROR "step 6's loss with sharded checkpoints ${loss_sharded}, without ${loss_full} (x 1e-4)")
endif()
run_command_ok("fsdp sharded 3 steps" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 3 --checkpoint ${shalf} --sharded-checkpoint)
run_command_ok("fsdp sharded resume" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 6 --checkpoint ${shalf} --sharded-checkpoint
       --resume)
foreach(rank 0 1)
  file(SHA256 ${sfull}.rank${rank}-of-2 full_hash)
  file(SHA256 ${shalf}.rank${rank}-of-2 half_hash)
  if(NOT full_hash STREQUAL half_hash)
    message(FATAL_ERROR "rank ${rank}'s shard: 6 steps and 3 + resume + 3 differ")
  endif()
endforeach()
if(EXISTS ${sfull} OR EXISTS ${sfull}.rank2-of-2)
  message(FATAL_ERROR "a sharded checkpoint wrote files other than the ranks' shards")
endif()
# A shard records its run's settings and a resume must repeat them, on every rank: shards of a run that
# differed only in --lr (which no other header field records) are refused by name, alone or one of them mixed
# with this run's own, instead of training on from another run's state. --steps may change (above), and so
# the cosine's length that follows it unless given; but the files of one checkpoint must be of one run.
set(slr ${WORKDIR}/fsdp_sharded_lr.ckpt)
set(smix ${WORKDIR}/fsdp_sharded_mix.ckpt)
file(REMOVE ${slr}.rank0-of-2 ${slr}.rank1-of-2 ${smix}.rank0-of-2 ${smix}.rank1-of-2)
run_command_ok("fsdp sharded 3 steps, --lr 0.002" ${mpi2} ${FLASHLM} train ${fsdp_args} --lr 0.002 --steps 3
               --checkpoint ${slr} --sharded-checkpoint)
run_command_ok("fsdp sharded 3 steps, for the mix" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 3 --checkpoint ${smix}
               --sharded-checkpoint)
file(COPY_FILE ${slr}.rank1-of-2 ${smix}.rank1-of-2)
foreach(case "lr;${slr};[01]" "mix;${smix};1")
  list(GET case 0 what)
  list(GET case 1 ckpt)
  list(GET case 2 rank)
  execute_process(COMMAND ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 6 --checkpoint ${ckpt} --sharded-checkpoint
                          --resume
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  if(rc EQUAL 0 OR NOT err MATCHES "error: rank ${rank}: train: checkpoint '[^']*rank${rank}-of-2': this shard was written by a run with a different configuration: optimizer.lr_max is 0.002 there, 0.003 in this run"
     OR out MATCHES "step +4/6")
    message(FATAL_ERROR "sharded resume (${what}) from a run with another --lr: exit ${rc}\nstdout: ${out}\nstderr: ${err}")
  endif()
endforeach()
string(REPLACE "--cosine-steps;6" "--cosine-steps;7" cosine7_args "${fsdp_args}")
set(scos ${WORKDIR}/fsdp_sharded_cosine.ckpt)
file(REMOVE ${scos}.rank0-of-2 ${scos}.rank1-of-2)
run_command_ok("fsdp sharded 3 steps, --cosine-steps 7" ${mpi2} ${FLASHLM} train ${cosine7_args} --steps 3
               --checkpoint ${scos} --sharded-checkpoint)
file(COPY_FILE ${scos}.rank1-of-2 ${smix}.rank1-of-2)
execute_process(COMMAND ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 6 --checkpoint ${smix} --sharded-checkpoint --resume
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(rc EQUAL 0 OR NOT err MATCHES "the files of the sharded checkpoint '[^']*fsdp_sharded_mix.ckpt' are not of one run: rank 1's run configuration differs from rank 0's in optimizer.cosine_steps \\(rank 0: 6, rank 1: 7\\)"
   OR out MATCHES "step +4/6")
  message(FATAL_ERROR "sharded resume from a mix of two runs' shards: exit ${rc}\nstdout: ${out}\nstderr: ${err}")
endif()
run_command_ok("fsdp sharded resume, another cosine" ${mpi2} ${FLASHLM} train ${fsdp_args} --steps 6 --checkpoint ${scos}
               --sharded-checkpoint --resume)
# Shards are of one world size: another is refused (the gathered checkpoint is the portable one).
execute_process(COMMAND ${FLASHLM} train ${common} --batch 4 --ddp fsdp --steps 7 --checkpoint ${shalf}
                        --sharded-checkpoint --resume
                RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 1 OR NOT err MATCHES "fsdp_sharded_half.ckpt.rank0-of-1'?: cannot open")
  message(FATAL_ERROR "sharded resume at another world size: exit ${rc}\nstderr: ${err}")
endif()

set(json_file ${WORKDIR}/fsdp_bench.json)
file(REMOVE ${json_file})
run_command_ok("ddp-bench fsdp" ${mpi2} ${FLASHLM} ddp-bench --device cpu --model tiny --vocab 64 --context 16 --batch 2
       --ddp bucketed,fsdp --bucket-mb 1 --zero 0,1 --warmup 1 --steps 2 --format json --out ${json_file})
file(READ ${json_file} json)
string(JSON n LENGTH "${json}" records)
if(NOT n EQUAL 4)  # none, bucketed, fsdp (once), bucketed + ZeRO-1
  message(FATAL_ERROR "json: ${n} records, expected 4:\n${json}")
endif()
string(JSON variant GET "${json}" records 2 variant)
string(JSON status GET "${json}" records 2 status)
string(JSON sync GET "${json}" records 2 gradient_sync)
string(JSON gathered TYPE "${json}" records 2 gathered_mib)
string(JSON fsdp_params GET "${json}" records 2 parameters_mib)
string(JSON ddp_params GET "${json}" records 1 parameters_mib)
string(JSON peak TYPE "${json}" records 2 peak_mib)
if(NOT variant STREQUAL "fsdp" OR NOT status STREQUAL "ok" OR NOT sync STREQUAL "reduce-scatter"
   OR NOT gathered STREQUAL "NUMBER" OR NOT peak STREQUAL "NUMBER")
  message(FATAL_ERROR "json: the fsdp row:\n${json}")
endif()
if(NOT fsdp_params LESS ddp_params)  # about half at two ranks (test_fsdp checks the bound)
  message(FATAL_ERROR "json: FSDP keeps ${fsdp_params} MiB of parameters per rank, DDP ${ddp_params}:\n${json}")
endif()

foreach(bad "train;--fsdp-prefetch;3" "ddp-bench;--fsdp-prefetch;-1" "train;--ddp;zero3"
            "train;--ddp;bucketed;--checkpoint;x;--sharded-checkpoint" "train;--ddp;fsdp;--sharded-checkpoint")
  execute_process(COMMAND ${FLASHLM} ${bad} RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "^error: ")
    message(FATAL_ERROR "flashlm ${bad}: exit ${rc}, expected 2 with 'error: '\nstderr: ${err}")
  endif()
endforeach()
