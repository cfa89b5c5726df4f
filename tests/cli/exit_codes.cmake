# Exit codes of the CLI: 2 for usage errors, 0 for help and for a good run.
function(expect_exit code)
  execute_process(COMMAND ${FLASHLM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL code)
    message(FATAL_ERROR "flashlm ${ARGN}: exit ${rc}, expected ${code}\nstdout: ${out}\nstderr: ${err}")
  endif()
  if(code EQUAL 2 AND NOT err MATCHES "^error: ")
    message(FATAL_ERROR "flashlm ${ARGN}: usage error without 'error: ' on stderr: ${err}")
  endif()
endfunction()

expect_exit(0 --help)
expect_exit(0 attention-bench --help)
expect_exit(2)
expect_exit(2 no-such-command)
expect_exit(2 attention-bench --impl fast)
expect_exit(2 attention-bench --dtype fp4)
expect_exit(2 attention-bench --seq 12x)
expect_exit(2 attention-bench --causal=2)
expect_exit(2 attention-bench --format xml)
expect_exit(2 attention-bench --reps 0)
expect_exit(2 attention-bench --d-v -1)
expect_exit(2 attention-bench --device tpu)
expect_exit(2 attention-bench --grid nope)
expect_exit(2 attention-bench --grid fa --seq 128)
expect_exit(2 attention-bench --page-size 64)
expect_exit(2 attention-bench --decode --page-size 8)
expect_exit(2 attention-bench --decode --grid fa)
expect_exit(2 attention-bench --decode --heads 32 --kv-heads 3)
expect_exit(2 attention-bench --decode --d 64,128)
expect_exit(0 attention-bench --seq 16 --d 8 --reps 1 --warmup 0 --quiet)
expect_exit(0 bench --help)
expect_exit(2 bench --model huge)
expect_exit(2 bench --pass backwards)
expect_exit(2 bench --cuda-graph maybe)
expect_exit(2 train --cuda-graph 1)
expect_exit(0 bench --device cpu --model tiny --context 16 --batch 1 --pass step --warmup 0 --steps 1 --cuda-graph off --quiet)
expect_exit(2 bench --precision fp4)
expect_exit(2 bench --device cpu --model tiny --profile-kernels)
expect_exit(2 bench --device cpu --model tiny --gemm-autotune 4)
expect_exit(2 bench --device cpu --model tiny --overlap-grad-norm)
expect_exit(0 bench --model tiny --context 16 --batch 2 --vocab 64 --warmup 0 --steps 1 --precision fp32,bf16 --quiet)
expect_exit(2 bench --recompute sometimes)
expect_exit(2 bench --recompute blocks:0)
expect_exit(2 bench --context 70000)
expect_exit(2 bench --head-chunk -1)
expect_exit(2 bench --model-config /nonexistent/model.json)
expect_exit(0 bench --device cpu --model tiny --context 16 --batch 2 --vocab 64 --warmup 0 --steps 1 --pass step --recompute auto --quiet)
expect_exit(0 train --help)
expect_exit(2 train --device cpu --precision bf16-pure)
expect_exit(2 train --recompute blocks:x)
expect_exit(2 train --context 65537)
expect_exit(2 train --model-config /nonexistent/model.json)
expect_exit(0 train --device cpu --steps 2 --batch 2 --context 16 --recompute blocks:1 --eval-batches 1)
expect_exit(0 train --device cpu --precision fp8 --fp8-gradients e4m3 --steps 2 --batch 2 --context 16 --eval-batches 1)
expect_exit(0 train --device cpu --precision fp8 --fp8-recipe rowwise --steps 2 --batch 2 --context 16 --eval-batches 1)
expect_exit(2 train --precision fp8 --fp8-recipe columnwise)
expect_exit(2 train --device cpu --precision bf16)
expect_exit(2 train --model huge)
expect_exit(2 train --heads 3)
expect_exit(2 train --device cpu --precision bf16)
expect_exit(2 train --device tpu)
expect_exit(2 train --steps 0)
expect_exit(1 train --device cpu --data /nonexistent/tokens.bin --steps 1)
expect_exit(0 train --device cpu --steps 3 --batch 2 --context 16 --log-every 1 --eval-batches 1)
expect_exit(2 train --optimizer-state bf8)
expect_exit(2 bench --optimizer-state fp16)
expect_exit(2 ddp-bench --optimizer-state bf16-rn)
expect_exit(2 train --device cpu --optimizer-state bf16 --zero 1)
expect_exit(2 train --device cpu --optimizer-state bf16-sr --ddp fsdp)
expect_exit(2 train --device cpu --precision fp32 --loss-scale-init 1024)
expect_exit(0 train --device cpu --steps 2 --batch 2 --context 16 --eval-batches 1 --optimizer-state bf16-sr)
expect_exit(0 bench --device cpu --model tiny --context 16 --batch 1 --pass step --warmup 0 --steps 1 --optimizer-state bf16 --quiet)
expect_exit(0 allreduce-bench --help)
expect_exit(2 allreduce-bench --sizes 12XB)
expect_exit(2 allreduce-bench --sizes 0)
expect_exit(2 allreduce-bench --dtype bf16)
expect_exit(2 allreduce-bench --device tpu)
expect_exit(2 allreduce-bench --iters 0)
expect_exit(2 allreduce-bench --format xml)
expect_exit(0 allreduce-bench --sizes 1KB,2KiB --iters 1 --warmup 0 --quiet)

# Issue 14: sizes that overflow, unbounded options and usage errors that exited 1 (each a usage error now).
expect_exit(2 attention-bench --device cpu --batch 4611686018427387905 --seq 4 --d 4)
expect_exit(2 attention-bench --seq 99999999999999999999)
expect_exit(2 attention-bench --d 5000)
expect_exit(2 attention-bench --grid "")
expect_exit(2 attention-bench --threads -1)
expect_exit(2 attention-bench --threads 0)
expect_exit(2 attention-bench --threads 100000)
expect_exit(2 attention-bench --reps 99999999999999999999)
expect_exit(2 attention-bench --device cpu --seq 8 --d 16 --reps 1 --profile-kernels)
expect_exit(2 attention-bench --decode --device cpu --profile-kernels)
expect_exit(2 bench --device cpu --batch 4611686018427387905)
expect_exit(2 bench --context 9223372036854775807)
expect_exit(2 bench --threads 60000)
expect_exit(2 ddp-bench --device cpu --batch 4611686018427387905)
expect_exit(2 ddp-bench --vocab 2147483648)
expect_exit(2 ddp-bench --bucket-mb inf)
expect_exit(2 train --device cpu --d-ff 9223372036854775807)
expect_exit(2 train --device cpu --layers 9223372036854775807)
expect_exit(2 train --device cpu --d-model -64)
expect_exit(2 train --device cpu --threads 100000)
expect_exit(2 train --device cpu --threads -1)
expect_exit(2 train --batch 2147483648)
expect_exit(2 train --context 2147483648)
expect_exit(2 train --vocab 2147483648)
expect_exit(2 train --eval-batches 0)
expect_exit(2 train --steps 99999999999999999999)
expect_exit(2 train --seed 99999999999999999999)
expect_exit(2 train --seed -1)
foreach(bad nan inf -1)
  expect_exit(2 train --lr ${bad})
endforeach()
expect_exit(2 train --beta1 2)
expect_exit(2 train --beta2 nan)
expect_exit(2 train --beta2 1)
expect_exit(2 train --weight-decay nan)
expect_exit(2 train --clip nan)
expect_exit(2 train --bucket-mb nan)
expect_exit(2 allreduce-bench --iters 99999999999999999999)

# A CPU row that would compute for hours is skipped with its FLOP count instead of run.
execute_process(COMMAND ${FLASHLM} attention-bench --device cpu --seq 10000000 --impl flash --format csv
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "skipped" OR NOT err MATCHES "FLOPs on the CPU, above the limit")
  message(FATAL_ERROR "attention-bench --seq 10000000 on the CPU: exit ${rc}, expected a skipped row\n${out}\n${err}")
endif()

# generate's batch and paged-cache flags: bad values are usage errors, found before any file is read.
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --batch 0)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --batch 70000)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --page-size 8)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --page-size 24)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --page-size 512)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --kv-cache fancy)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --cuda-graph maybe)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --prompt b --batch 3)
expect_exit(2 generate --checkpoint /nonexistent/run.ckpt --prompt a --kv-cache contiguous --batch 2)

# The audit of 2026-12-07: settings that were ignored, fell back silently or took any number. Each bad value is an
# error naming the setting; each combination a run would ignore is refused. `env` is NAME=VALUE or "" for none.
function(expect_error code pattern env)
  set(launcher ${CMAKE_COMMAND} -E env)
  if(env STREQUAL "")
    set(launcher)
  endif()
  execute_process(COMMAND ${launcher} ${env} ${FLASHLM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL code OR NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "${env} flashlm ${ARGN}: exit ${rc}, expected ${code} and '${pattern}'\nstdout: ${out}\n"
                        "stderr: ${err}")
  endif()
endfunction()

# The FLASHLM_* choices: checked for every command before it runs, exactly (case, trailing characters).
expect_error(2 "^error: FLASHLM_FP8_KEY_BLOCK: unknown value '128x': expected auto, 128 or 192"
             FLASHLM_FP8_KEY_BLOCK=128x info)
expect_error(2 "^error: FLASHLM_FP8_KEY_BLOCK: unknown value '256'" FLASHLM_FP8_KEY_BLOCK=256
             attention-bench --device cpu --seq 16 --d 8 --reps 1 --warmup 0 --quiet)
expect_error(2 "^error: FLASHLM_ATTENTION_KERNEL: unknown value 'MMA': expected auto or mma"
             FLASHLM_ATTENTION_KERNEL=MMA info)
expect_error(2 "^error: FLASHLM_SM90_BWD_SCHEDULE: unknown value 'Grid': expected auto, grid or persistent"
             FLASHLM_SM90_BWD_SCHEDULE=Grid info)
expect_error(2 "^error: FLASHLM_SM90_FWD_D64_TILE: unknown value '128'" FLASHLM_SM90_FWD_D64_TILE=128 info)
expect_error(2 "^error: FLASHLM_HOPPER_ALIBI_SINK: unknown value 'yes': expected 0 or 1"
             FLASHLM_HOPPER_ALIBI_SINK=yes info)
expect_error(2 "^error: FLASHLM_PROGRAMMATIC_LAUNCH: unknown value '2': expected 0 or 1"
             FLASHLM_PROGRAMMATIC_LAUNCH=2 info)
expect_error(0 "" FLASHLM_PROGRAMMATIC_LAUNCH= info)  # empty is the default, as for every other choice
expect_error(0 "" FLASHLM_FP8_KEY_BLOCK=192 info)
expect_error(2 "^error: FLASHLM_DIST_TIMEOUT_S: '1e300' is not a number of seconds in \\[0, 604800\\]"
             FLASHLM_DIST_TIMEOUT_S=1e300 info)
expect_error(2 "^error: FLASHLM_DIST_TIMEOUT_S: '10s'" FLASHLM_DIST_TIMEOUT_S=10s info)
expect_error(2 "^error: FLASHLM_DIST_TIMEOUT_S: 'nan'" FLASHLM_DIST_TIMEOUT_S=nan info)
expect_error(0 "" FLASHLM_DIST_TIMEOUT_S=60 info)
expect_error(2 "^error: CPU kernel instruction set 'avx9000' \\(FLASHLM_CPU_ISA" FLASHLM_CPU_ISA=avx9000 info)

# FP8-only options without an FP8 precision, a CUDA graph on the CPU: refused, not ignored.
expect_error(2 "^error: --fp8-recipe: applies to --precision fp8" ""
             bench --device cpu --model tiny --context 16 --batch 1 --pass fwd --warmup 0 --steps 1
             --fp8-recipe rowwise)
expect_error(2 "^error: --fp8-gradients: applies to --precision fp8" ""
             bench --device cpu --model tiny --precision fp32 --fp8-gradients e4m3)
expect_error(2 "^error: --fp8-recipe: applies to --precision fp8" "" train --device cpu --fp8-recipe tensorwise)
expect_error(2 "^error: --fp8-gradients: applies to --precision fp8" "" train --device cpu --fp8-gradients e5m2)
expect_error(2 "^error: --cuda-graph on: needs --device cuda" "" bench --device cpu --model tiny --cuda-graph on)
expect_error(2 "^error: --cuda-graph on: needs --device cuda" "" train --device cpu --cuda-graph on)
expect_exit(0 bench --device cpu --model tiny --context 16 --batch 1 --vocab 64 --pass fwd --warmup 0 --steps 1
            --precision fp32,fp8 --fp8-recipe rowwise --quiet)

# attention-bench: a NaN soft-cap, a window that is not numbers, and the options --decode does not use.
expect_error(2 "^error: --softcap: 'nan' is not a number" "" attention-bench --softcap nan)
expect_error(2 "^error: --softcap: '-1' is not a number" "" attention-bench --softcap -1)
expect_error(2 "^error: --window: 'a' is not -1 or a number of keys" "" attention-bench --window a,b)
foreach(unused "--window;4,4" "--softcap;3" "--seq;64" "--impl;flash" "--forward-only" "--deterministic"
               "--causal-align;bottom-right" "--cpu-max-flops;1e9")
  expect_error(2 "^error: .*--decode" "" attention-bench --decode --device cpu ${unused})
endforeach()
# --decode's configuration every row would fail: refused before the sweep instead of recorded row by row.
expect_error(2 "^error: attention-bench --decode: page size 24 \\(--page-size\\): expected a multiple of 16" ""
             attention-bench --decode --device cpu --page-size 24)
expect_error(2 "^error: attention-bench --decode: cache length 100 \\(--cache\\) is not a positive multiple" ""
             attention-bench --decode --device cpu --cache 100)
expect_error(2 "^error: attention-bench --decode: dtype fp8_e4m3 has no KV-cache decoding" ""
             attention-bench --decode --device cpu --dtype fp8)

# --out: the table reaches stdout before the file is written, and a file that cannot be written (exit 1) or is
# written leaves no temporary; an existing file is replaced whole.
set(out_dir ${CMAKE_CURRENT_BINARY_DIR}/exit_codes_out)
file(REMOVE_RECURSE ${out_dir})
file(MAKE_DIRECTORY ${out_dir})
set(small attention-bench --device cpu --impl flash --seq 16 --d 8 --reps 1 --warmup 0 --quiet)
execute_process(COMMAND ${FLASHLM} ${small} --format json --out ${out_dir}/missing/report.json RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1 OR NOT out MATCHES "\\| flash \\|" OR NOT err MATCHES "^error: cannot open")
  message(FATAL_ERROR "--out into a missing directory: exit ${rc}\nstdout: ${out}\nstderr: ${err}")
endif()
file(WRITE ${out_dir}/report.json "an older report\n")
expect_exit(0 ${small} --format json --out ${out_dir}/report.json)
file(READ ${out_dir}/report.json report)
file(GLOB left_over ${out_dir}/report.json.tmp.*)
if(NOT report MATCHES "^\\{" OR left_over)
  message(FATAL_ERROR "--out over an existing file: '${report}', temporaries ${left_over}")
endif()

# --grad-dtype (bf16 weight gradients): a bad value, and every run it cannot apply to, refused before any
# work (bench's precisions and --device cuda are checked before it looks for a GPU, so these hold on the CPU too).
expect_exit(2 bench --grad-dtype fp16)
expect_exit(2 train --grad-dtype bf8)
expect_exit(2 ddp-bench --grad-dtype bf16)
expect_error(2 "^error: --grad-dtype bf16 needs --device cuda" "" bench --device cpu --model tiny --grad-dtype bf16)
expect_error(2 "^error: --grad-dtype bf16 needs --device cuda" "" train --device cpu --grad-dtype bf16)
expect_error(2 "^error: --grad-dtype bf16 needs --device cuda" "" train --device cpu --precision fp8 --grad-dtype bf16)
expect_error(2 "^error: --grad-dtype bf16 needs --precision bf16 or fp8.*not fp16" ""
             bench --device cuda --precision fp16 --grad-dtype bf16)
expect_error(2 "^error: --grad-dtype bf16 needs --precision bf16 or fp8.*not fp32" ""
             bench --device cuda --precision fp8,fp32 --grad-dtype bf16)
expect_error(2 "^error: --grad-dtype bf16 is for fp32 master weights; bf16-pure keeps bf16 gradients" ""
             bench --device cuda --precision bf16,bf16-pure --grad-dtype bf16)
expect_error(2 "^error: --grad-dtype bf16 is for fp32 master weights; bf16-pure-fp8 keeps bf16 gradients" ""
             bench --device cuda --precision bf16-pure-fp8 --grad-dtype bf16)
expect_exit(0 train --device cpu --steps 1 --batch 2 --context 16 --eval-batches 1 --grad-dtype fp32)
