# flashlm train and ddp-bench under mpirun -np 2 on the CPU: data-parallel training reports once (rank 0)
# and resumes bit-exactly with ZeRO-1's sharded moments; ddp-bench gives one table and every JSON field;
# bad arguments are usage errors. Arguments: FLASHLM, MPIRUN, MPIRUN_FLAGS (a list), WORKDIR.
set(mpi2 ${MPIRUN} ${MPIRUN_FLAGS} -np 2)
set(tiny --device cpu --model tiny --vocab 64 --context 16 --batch 2 --eval-every 0 --eval-batches 1
         --ddp bucketed --bucket-mb 0.01 --grad-accum 2 --zero 1)

include(${CMAKE_CURRENT_LIST_DIR}/flashlm_commands.cmake)

# 6 steps in one go, and 3 steps then a resumed 3: the same checkpoint, byte for byte.
set(full ${WORKDIR}/ddp_full.ckpt)
set(half ${WORKDIR}/ddp_half.ckpt)
file(REMOVE ${full} ${half})
run_command_ok("train 6 steps" ${mpi2} ${FLASHLM} train ${tiny} --steps 6 --cosine-steps 6 --log-every 1 --checkpoint ${full})
string(REGEX MATCHALL "step +6/6 \\| loss" last_lines "${out}")
list(LENGTH last_lines n_last)
if(NOT n_last EQUAL 1 OR NOT out MATCHES "data parallel: 2 rank\\(s\\) x 2 sequences x grad_accum 2; DDP bucketed"
   OR NOT out MATCHES "ZeRO-1: [0-9.]+ MiB of AdamW state per rank")
  message(FATAL_ERROR "expected rank 0's progress once, with the data-parallel line:\n${out}")
endif()
run_command_ok("train 3 steps" ${mpi2} ${FLASHLM} train ${tiny} --steps 3 --cosine-steps 6 --checkpoint ${half})
run_command_ok("resume to 6 steps" ${mpi2} ${FLASHLM} train ${tiny} --steps 6 --cosine-steps 6 --checkpoint ${half} --resume)
file(SHA256 ${full} full_hash)
file(SHA256 ${half} half_hash)
if(NOT full_hash STREQUAL half_hash)
  message(FATAL_ERROR "6 steps and 3 + resume + 3 under DDP + ZeRO-1 wrote different checkpoints")
endif()
# Resuming with another world size would read other data: refused.
execute_process(COMMAND ${FLASHLM} train ${tiny} --steps 7 --checkpoint ${half} --resume
                RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 1 OR NOT err MATCHES "differs from this run in world_size: the checkpoint has 2, this run 1")
  message(FATAL_ERROR "resume at another world size: exit ${rc}\nstderr: ${err}")
endif()

set(json_file ${WORKDIR}/ddp_bench.json)
file(REMOVE ${json_file})
run_command_ok("ddp-bench" ${mpi2} ${FLASHLM} ddp-bench --device cpu --model tiny --vocab 64 --context 16 --batch 2
       --bucket-mb 0.01,1 --reduce-dtype fp32 --zero 0,1 --warmup 1 --steps 2 --format json --out ${json_file})
string(REGEX MATCHALL "\\| *variant *\\| *bucket MB *\\| *all-reduce in *\\|" headers "${out}")
list(LENGTH headers n_headers)
if(NOT n_headers EQUAL 1 OR NOT err MATCHES "ddp-bench: 2 rank\\(s\\)" OR NOT err MATCHES "\\[11/11\\] bucketed 1 MB \\+ ZeRO-1")
  message(FATAL_ERROR "expected one table (rank 0) and progress lines:\nstdout: ${out}\nstderr: ${err}")
endif()
file(READ ${json_file} json)
string(JSON n LENGTH "${json}" records)
string(JSON world GET "${json}" world_size)
if(NOT n EQUAL 11 OR NOT world EQUAL 2)  # none + (per-param, flat, async, bucketed x 2) x ZeRO-1 off/on
  message(FATAL_ERROR "json: ${n} records (expected 11), world_size ${world}:\n${json}")
endif()
foreach(i 0 5 10)
  foreach(field variant bucket_mb reduce_dtype zero1 world_size buckets mean_ms median_ms exposed_comm_ms
                tokens_per_s scaling_efficiency optimizer_state_mib staging_mib status)
    string(JSON value ERROR_VARIABLE missing GET "${json}" records ${i} ${field})
    if(missing)
      message(FATAL_ERROR "json record ${i} lacks '${field}': ${missing}")
    endif()
  endforeach()
  string(JSON status GET "${json}" records ${i} status)
  if(NOT status STREQUAL "ok")
    message(FATAL_ERROR "json record ${i}: status ${status}:\n${json}")
  endif()
endforeach()
string(JSON eff TYPE "${json}" records 5 scaling_efficiency)
string(JSON zero GET "${json}" records 10 zero1)
string(JSON none_dtype TYPE "${json}" records 0 reduce_dtype)  # the step without communication
string(JSON dtype GET "${json}" records 5 reduce_dtype)
if(NOT eff STREQUAL "NUMBER" OR NOT zero OR NOT none_dtype STREQUAL "NULL" OR NOT dtype STREQUAL "fp32")
  message(FATAL_ERROR "json: scaling efficiency ${eff}, ZeRO-1 ${zero}, reduce_dtype ${none_dtype}, ${dtype}:\n${json}")
endif()

# The model options train takes, through the same parsing: --recompute (auto resolved per row and named in
# the row), --head-chunk, --atomic-attention-backward; FSDP's row and the plain one.
set(json_file ${WORKDIR}/ddp_bench_recompute.json)
file(REMOVE ${json_file})
run_command_ok("ddp-bench --recompute" ${mpi2} ${FLASHLM} ddp-bench --device cpu --model tiny --vocab 64 --context 16
       --batch 2 --ddp fsdp --recompute blocks:1 --head-chunk 8 --atomic-attention-backward --warmup 1 --steps 2
       --format json --out ${json_file})
file(READ ${json_file} json)
foreach(i 0 1)
  string(JSON recompute GET "${json}" records ${i} recompute)
  string(JSON status GET "${json}" records ${i} status)
  if(NOT recompute STREQUAL "blocks:1" OR NOT status STREQUAL "ok")
    message(FATAL_ERROR "json record ${i}: recompute ${recompute}, status ${status}:\n${json}")
  endif()
endforeach()

# bf16 AdamW moments: the rows without communication and plain DDP run; ZeRO-1's rows are "error" rows
# naming why (its sharded optimizer keeps fp32 moments).
set(json_file ${WORKDIR}/ddp_bench_moments.json)
file(REMOVE ${json_file})
run_command_ok("ddp-bench --optimizer-state bf16" ${mpi2} ${FLASHLM} ddp-bench --device cpu --model tiny --vocab 64
       --context 16 --batch 2 --ddp bucketed --bucket-mb 1 --zero 0,1 --optimizer-state bf16 --warmup 1 --steps 2
       --format json --out ${json_file})
file(READ ${json_file} json)
string(JSON n LENGTH "${json}" records)
foreach(i RANGE 0 2)
  string(JSON status GET "${json}" records ${i} status)
  string(JSON zero GET "${json}" records ${i} zero1)
  string(JSON message ERROR_VARIABLE none GET "${json}" records ${i} message)
  if(zero AND (NOT status STREQUAL "error" OR NOT message MATCHES "ZeRO-1 and FSDP shard fp32 moments"))
    message(FATAL_ERROR "json record ${i} (ZeRO-1): status ${status}, message ${message}:
${json}")
  elseif(NOT zero AND NOT status STREQUAL "ok")
    message(FATAL_ERROR "json record ${i}: status ${status}:
${json}")
  endif()
endforeach()
if(NOT n EQUAL 3)  # none, bucketed, bucketed + ZeRO-1
  message(FATAL_ERROR "json: ${n} records (expected 3):
${json}")
endif()

# Usage errors: exit 2 with "error: ..." without mpirun; under mpirun every rank fails and so does mpirun.
foreach(bad "train;--ddp;ring" "train;--zero;2" "train;--grad-accum;0" "ddp-bench;--ddp;ring"
            "ddp-bench;--bucket-mb;0" "ddp-bench;--zero;3" "ddp-bench;--device;cpu;--precision;bf16"
            "train;--device;cpu;--reduce-dtype;fp64" "train;--device;cpu;--nccl-max-ctas;4"
            "ddp-bench;--reduce-dtype;fp8" "ddp-bench;--device;cpu;--reduce-dtype;fp32,fp16"
            "ddp-bench;--nccl-max-ctas;0" "ddp-bench;--gemm-sm-reserve;-1" "train;--gemm-sm-reserve;x"
            "train;--device;cpu;--gemm-sm-reserve;8" "ddp-bench;--device;cpu;--precision;bf16-pure"
            "ddp-bench;--recompute;sometimes" "ddp-bench;--head-chunk;-1")
  execute_process(COMMAND ${FLASHLM} ${bad} RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "^error: ")
    message(FATAL_ERROR "flashlm ${bad}: exit ${rc}, expected 2 with 'error: '\nstderr: ${err}")
  endif()
endforeach()
# A 16-bit all-reduce is NCCL's: on the CPU the error says what to do.
execute_process(COMMAND ${FLASHLM} train --device cpu --reduce-dtype bf16
                RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 2 OR NOT err MATCHES "bf16 gradient reduction needs --device cuda \\(NCCL\\)")
  message(FATAL_ERROR "train --device cpu --reduce-dtype bf16: exit ${rc}\nstderr: ${err}")
endif()
execute_process(COMMAND ${mpi2} ${FLASHLM} ddp-bench --ddp ring RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
if(rc EQUAL 0 OR NOT err MATCHES "error: ")
  message(FATAL_ERROR "mpirun ddp-bench --ddp ring: exit ${rc}, expected non-zero\nstderr: ${err}")
endif()
