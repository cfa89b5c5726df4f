# The path from a text file to a sample of docs/usage.md (and the quick start), as a user types it: prepare, train
# (with --log), generate (the same text for the same seed, from the checkpoint and from its export), export, train
# --init; and the exit codes of these commands' bad arguments. Arguments: FLASHLM, WORKDIR.
set(dir ${WORKDIR}/text2model)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(text "")
foreach(i RANGE 60)
  string(APPEND text "Paragraph ${i}: a text that ships with the test, repeated so that a tiny model learns it.\n")
endforeach()
file(WRITE ${dir}/text.txt "${text}")

include(${CMAKE_CURRENT_LIST_DIR}/flashlm_commands.cmake)

run_ok("prepare" prepare ${dir}/text.txt --out ${dir})
if(NOT out MATCHES "train.bin: [0-9]+ tokens" OR NOT EXISTS ${dir}/val.bin OR NOT EXISTS ${dir}/tokenizer.json)
  message(FATAL_ERROR "prepare wrote or said the wrong things:\n${out}")
endif()
set(train_args --device cpu --data ${dir}/train.bin --val-data ${dir}/val.bin --vocab 256 --model tiny --context 32
               --batch 4 --eval-every 0 --eval-batches 1)
run_ok("train" train ${train_args} --steps 6 --log-every 3 --checkpoint ${dir}/run.ckpt --log ${dir}/metrics.jsonl)
if(NOT out MATCHES "step +6/6 \\| loss [0-9.]+ \\| lr [^|]+\\| grad norm [0-9.]+ \\| [0-9]+ tok/s \\| [0-9.]+ ms/step \\| elapsed [0-9]+:[0-9][0-9] \\| ETA 0:00")
  message(FATAL_ERROR "the progress line lacks ms/step, elapsed or ETA:\n${out}")
endif()
file(STRINGS ${dir}/metrics.jsonl records)
list(LENGTH records n_records)
if(NOT n_records EQUAL 7)  # six steps and the final evaluation
  message(FATAL_ERROR "metrics.jsonl has ${n_records} lines, expected 7")
endif()

set(sample --prompt "Paragraph 3" --max-tokens 15 --temperature 0.9 --top-k 20 --seed 7)
run_ok("generate" generate --checkpoint ${dir}/run.ckpt --tokenizer ${dir}/tokenizer.json ${sample})
set(first "${out}")
if(NOT first MATCHES "^Paragraph 3")
  message(FATAL_ERROR "generate does not continue the prompt:\n${first}")
endif()
run_ok("generate again" generate --checkpoint ${dir}/run.ckpt ${sample})
if(NOT out STREQUAL first)
  message(FATAL_ERROR "the same seed gave two samples:\n${first}\n${out}")
endif()
run_ok("export" export ${dir}/run.ckpt ${dir}/model.safetensors)
run_ok("generate from the export" generate --checkpoint ${dir}/model.safetensors ${sample})
if(NOT out STREQUAL first)
  message(FATAL_ERROR "the exported weights gave another sample:\n${first}\n${out}")
endif()
run_ok("train --init" train ${train_args} --steps 2 --init ${dir}/model.safetensors)
if(NOT out MATCHES "initialised from .*model.safetensors")
  message(FATAL_ERROR "train --init did not say where its weights came from:\n${out}")
endif()

expect_exit(2 "required" prepare ${dir}/text.txt)
expect_exit(2 "val-fraction" prepare ${dir}/text.txt --out ${dir} --val-fraction 0.9)
# --out is created with its parents (a fresh checkout has no data/); a file in its place is an error.
run_ok("prepare --out new/data" prepare ${dir}/text.txt --out ${dir}/new/data)
if(NOT EXISTS ${dir}/new/data/train.bin)
  message(FATAL_ERROR "prepare did not create --out ${dir}/new/data:\n${out}")
endif()
expect_exit(1 "cannot create the output directory" prepare ${dir}/text.txt --out ${dir}/text.txt)
expect_exit(1 "cannot open" prepare ${dir}/missing.txt --out ${dir})
# The BPE path's inputs follow the byte path's rule, checked before scripts/prepare_data.py starts (so no python
# with the tokenizers package is needed here): a FIFO would block it, a device be read without end.
execute_process(COMMAND mkfifo ${dir}/fifo RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mkfifo: exit ${rc}")
endif()
foreach(tokenizer byte bpe)
  set(vocab_size)
  if(tokenizer STREQUAL "bpe")
    set(vocab_size --vocab-size 300)
  endif()
  expect_exit(1 "'${dir}/fifo': not a regular file \\(a FIFO\\)" prepare ${dir}/text.txt ${dir}/fifo --out ${dir}
              --tokenizer ${tokenizer} ${vocab_size})
  expect_exit(1 "'/dev/zero': not a regular file \\(a device\\)" prepare /dev/zero --out ${dir} --tokenizer ${tokenizer}
              ${vocab_size})
endforeach()
# A helper that hangs is stopped (here after 1 s; by default after 10 minutes and more for a larger corpus).
file(WRITE ${dir}/hang.sh "exec sleep 300\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E env FLASHLM_PYTHON=/bin/sh FLASHLM_PREPARE_DATA_SCRIPT=${dir}/hang.sh
                        FLASHLM_PREPARE_DATA_TIMEOUT=1 ${FLASHLM} prepare ${dir}/text.txt --out ${dir} --tokenizer bpe
                        --vocab-size 300
                RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 1 OR NOT err MATCHES "^error: /bin/sh .*hang.sh did not finish within 1 s and was stopped")
  message(FATAL_ERROR "a helper that hangs: exit ${rc}\nstderr: ${err}")
endif()
# A timeout past a week (the deadline's nanoseconds would overflow) or with trailing junk is a usage error.
foreach(bad 1e300 5s)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env FLASHLM_PREPARE_DATA_TIMEOUT=${bad} ${FLASHLM} prepare ${dir}/text.txt
                          --out ${dir}/unused --tokenizer bpe --vocab-size 300
                  RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "^error: FLASHLM_PREPARE_DATA_TIMEOUT: '${bad}' is not a number of seconds")
    message(FATAL_ERROR "FLASHLM_PREPARE_DATA_TIMEOUT=${bad}: exit ${rc}\nstderr: ${err}")
  endif()
endforeach()
expect_exit(2 "--prompt" generate --checkpoint ${dir}/run.ckpt --prompt=)  # cmake cannot pass an empty argument
# The default of 200 new tokens on a model of context 32: the window slides (one logits row per new token), and
# the same seed still gives the same text; a prompt longer than the context keeps its last 32 tokens.
set(long --checkpoint ${dir}/run.ckpt --prompt "Paragraph 3" --seed 3)
run_ok("generate the default beyond the context" generate ${long} --logits-out ${dir}/long.f32)
set(first "${out}")
file(SIZE ${dir}/long.f32 long_bytes)
if(NOT long_bytes EQUAL 204800)  # 200 x 256 x 4
  message(FATAL_ERROR "generate's default past the context wrote ${long_bytes} bytes of logits, expected 204800")
endif()
file(GLOB left_over ${dir}/long.f32.tmp.*)
if(left_over)
  message(FATAL_ERROR "generate --logits-out left its temporary behind: ${left_over}")
endif()
run_ok("generate beyond the context again" generate ${long})
if(NOT out STREQUAL first)
  message(FATAL_ERROR "the same seed gave two samples beyond the context:\n${first}\n${out}")
endif()
string(REPEAT "Paragraph 3 " 4 long_prompt)
run_ok("generate from a prompt longer than the context" generate --checkpoint ${dir}/run.ckpt --prompt "${long_prompt}"
       --max-tokens 5)
# A batch (--batch, repeated --prompt) through the paged KV cache: sequence b is the text of seed + b alone, and
# the paged decoder gives the contiguous one's text; a tokens/s summary on stderr.
set(batched --checkpoint ${dir}/run.ckpt --max-tokens 40 --temperature 0.9 --top-k 20)
run_ok("generate seed 7" generate ${batched} --prompt "Paragraph 3" --seed 7)
set(seed7 "${out}")
if(NOT err MATCHES "contiguous KV cache" OR NOT err MATCHES "1 sequence x 40 new tokens in [0-9.]+ s: [0-9.]+ tokens/s")
  message(FATAL_ERROR "generate's summary lacks the cache or tokens/s:\n${err}")
endif()
run_ok("generate seed 7 paged" generate ${batched} --prompt "Paragraph 3" --seed 7 --kv-cache paged --page-size 16)
if(NOT out STREQUAL seed7 OR NOT err MATCHES "paged KV cache \\(fp32, batch 1, 2 pages of 16\\)")
  message(FATAL_ERROR "the paged decoder gave another text or said otherwise:\n${seed7}\n${out}\n${err}")
endif()
run_ok("generate seed 8" generate ${batched} --prompt "Paragraph 3" --seed 8)
set(seed8 "${out}")
run_ok("generate seed 10" generate ${batched} --prompt "Para" --seed 10)
set(seed10 "${out}")
run_ok("generate --batch 4" generate ${batched} --prompt "Paragraph 3" --prompt "Para" --batch 4 --seed 7 --page-size 32)
string(FIND "${out}" "--- sequence 0 (prompt 0, seed 7) ---\n${seed7}--- sequence 1 (prompt 0, seed 8) ---\n${seed8}" at0)
string(FIND "${out}" "--- sequence 3 (prompt 1, seed 10) ---\n${seed10}" at3)
if(NOT at0 EQUAL 0 OR at3 LESS 0 OR NOT err MATCHES "4 sequences x 40 new tokens in [0-9.]+ s: [0-9.]+ tokens/s")
  message(FATAL_ERROR "a batch's sequences are not the texts of seed + b alone:\n${out}\n${err}")
endif()
# Past the context (32) and from a prompt longer than it, in a batch: each window slides as generate's does.
run_ok("generate --batch past the context" generate --checkpoint ${dir}/run.ckpt --prompt "Paragraph 3" --seed 3
       --batch 2 --max-tokens 80 --page-size 16)
string(FIND "${out}" "--- sequence 1 (prompt 0, seed 4) ---" at1)
if(at1 LESS 0)
  message(FATAL_ERROR "generate --batch 2 past the context:\n${out}")
endif()
run_ok("generate --batch from a prompt longer than the context" generate --checkpoint ${dir}/run.ckpt
       --prompt "${long_prompt}" --batch 2 --max-tokens 5)
expect_exit(2 "--batch: 3 is not a multiple of the 2 prompts" generate --checkpoint ${dir}/run.ckpt --prompt a --prompt b
            --batch 3)
expect_exit(2 "--kv-cache: contiguous decodes one sequence" generate --checkpoint ${dir}/run.ckpt --prompt a --batch 2
            --kv-cache contiguous)
expect_exit(2 "--page-size: '8': expected a multiple of 16 in \\[16, 256\\]" generate --checkpoint ${dir}/run.ckpt
            --prompt a --page-size 8)
expect_exit(2 "--batch: '0' is not a number" generate --checkpoint ${dir}/run.ckpt --prompt a --batch 0)
expect_exit(2 "temperature" generate --checkpoint ${dir}/run.ckpt --prompt a --temperature -1)
expect_exit(2 "top-k" generate --checkpoint ${dir}/run.ckpt --prompt a --top-k -1)
expect_exit(2 "--device: 'tpu': expected cpu or cuda" generate --checkpoint ${dir}/run.ckpt --prompt a --device tpu)
# One sequence on the CPU decodes with the contiguous decoder, which has no pages: --page-size was ignored there.
expect_exit(2 "--page-size: 32: pages are the paged decoder's" generate --checkpoint ${dir}/run.ckpt --prompt a
            --page-size 32)
expect_exit(2 "--page-size: 32: pages are the paged decoder's" generate --checkpoint ${dir}/run.ckpt --prompt a
            --kv-cache contiguous --page-size 32)
expect_exit(2 "--cuda-graph: 'on': the CUDA graph is the paged decoder's on cuda; this run decodes with the contiguous"
            generate --checkpoint ${dir}/run.ckpt --prompt a --cuda-graph on)
# Without a GPU (CI), cuda is refused with the reason; with one, the same greedy sample as the CPU's.
execute_process(COMMAND ${FLASHLM} info OUTPUT_VARIABLE info)
if(info MATCHES "cuda: [0-9]")
  set(greedy --checkpoint ${dir}/run.ckpt --prompt "Paragraph 3" --max-tokens 15 --temperature 0)
  run_ok("generate on the cpu" generate ${greedy} --device cpu)
  set(on_cpu "${out}")
  run_ok("generate on cuda" generate ${greedy} --device cuda)
  if(NOT out STREQUAL on_cpu)
    message(FATAL_ERROR "greedy samples differ between the CPU and CUDA decoders:\n${on_cpu}\n${out}")
  endif()
  # The tiny model's head_dim 8 has no CUDA decoding kernel: auto keeps the contiguous fp32 decoder (above), and
  # paged is refused with the reason.
  if(NOT err MATCHES "contiguous KV cache")
    message(FATAL_ERROR "generate --device cuda on head_dim 8 did not keep the contiguous decoder:\n${err}")
  endif()
  expect_exit(2 "--kv-cache: the paged decoder on cuda: head_dim 8" generate ${greedy} --device cuda --kv-cache paged)
  # A model of head_dim 64 takes the paged bf16 decoder on cuda by default: a batch past the context (slides) and
  # prompts of different lengths.
  run_ok("train head_dim 64" train ${train_args} --steps 2 --d-model 128 --heads 2 --d-ff 128
         --checkpoint ${dir}/d64.ckpt)
  run_ok("generate --device cuda --batch" generate --checkpoint ${dir}/d64.ckpt --device cuda --prompt "Paragraph 3"
         --prompt "P" --batch 4 --max-tokens 80 --page-size 16 --seed 5)
  if(NOT err MATCHES "paged KV cache \\(bf16, batch 4, 8 pages of 16\\)" OR NOT err MATCHES "4 sequences x 80 new tokens"
     OR NOT out MATCHES "--- sequence 3 \\(prompt 1, seed 8\\) ---\nP")
    message(FATAL_ERROR "generate --device cuda --batch 4 on head_dim 64:\n${out}\n${err}")
  endif()
  set(bf16_first "${out}")
  run_ok("generate --device cuda --batch again" generate --checkpoint ${dir}/d64.ckpt --device cuda --prompt "Paragraph 3"
         --prompt "P" --batch 4 --max-tokens 80 --page-size 16 --seed 5)
  if(NOT out STREQUAL bf16_first)
    message(FATAL_ERROR "the same seed gave two batches on cuda:\n${bf16_first}\n${out}")
  endif()
  # The steps replayed as CUDA graphs (the default) and launched kernel by kernel give the same text.
  if(NOT err MATCHES "cuda graph on")
    message(FATAL_ERROR "generate --device cuda did not replay its steps as CUDA graphs:\n${err}")
  endif()
  run_ok("generate --device cuda --batch --cuda-graph off" generate --checkpoint ${dir}/d64.ckpt --device cuda
         --prompt "Paragraph 3" --prompt "P" --batch 4 --max-tokens 80 --page-size 16 --seed 5 --cuda-graph off)
  if(NOT out STREQUAL bf16_first OR NOT err MATCHES "cuda graph off: --cuda-graph off")
    message(FATAL_ERROR "generate --cuda-graph off gave another text or said otherwise:\n${bf16_first}\n${out}\n${err}")
  endif()
else()
  expect_exit(2 "--device: cuda: " generate --checkpoint ${dir}/run.ckpt --prompt a --device cuda)
endif()
expect_exit(1 "header length" generate --checkpoint ${dir}/train.bin --prompt a)
expect_exit(1 "cannot open" generate --checkpoint ${dir}/missing.ckpt --prompt a)
expect_exit(1 "not valid JSON" generate --checkpoint ${dir}/run.ckpt --prompt a --tokenizer ${dir}/text.txt)
expect_exit(1 "cannot open" export ${dir}/run.ckpt ${dir}/missing/model.safetensors)
expect_exit(1 "has shape \\[64, 32\\], this model.s is \\[48, 32\\]" train ${train_args} --steps 1 --init ${dir}/model.safetensors --d-ff 48)
expect_exit(1 "--init and --resume" train ${train_args} --steps 1 --init ${dir}/model.safetensors --checkpoint ${dir}/run.ckpt --resume)
expect_exit(1 "cannot open the metrics log" train ${train_args} --steps 1 --log ${dir}/missing/m.jsonl)

# Every JSON report says which flashlm, commit and command line made it, and when.
run_ok("attention-bench json" attention-bench --device cpu --seq 16 --d 8 --reps 1 --warmup 0 --quiet --format json)
string(JSON version GET "${out}" flashlm version)
string(JSON commit GET "${out}" flashlm git_commit)
string(JSON word GET "${out}" flashlm command 1)
string(JSON time GET "${out}" flashlm time_utc)
string(JSON device GET "${out}" device)
if(NOT version MATCHES "^[0-9]+\\.[0-9]+" OR commit STREQUAL "" OR NOT word STREQUAL "attention-bench"
   OR NOT time MATCHES "^20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]T" OR device STREQUAL "")
  message(FATAL_ERROR "the report's provenance is incomplete:\n${out}")
endif()

# torchrun's copies would each train alone: refused with a pointer to mpirun.
execute_process(COMMAND ${CMAKE_COMMAND} -E env WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 ${FLASHLM} info
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "^error: launched by torchrun \\(WORLD_SIZE=2, RANK=1\\).*mpirun -np 2")
  message(FATAL_ERROR "torchrun's environment: exit ${rc}\nstderr: ${err}")
endif()

# bench --trace: a Chrome trace with the timed steps' ranges (ph X) and the memory counter (ph C).
run_ok("bench --trace" bench --device cpu --model tiny --context 16 --batch 1 --warmup 0 --steps 1 --pass step --quiet
       --trace ${dir}/trace.json)
file(READ ${dir}/trace.json trace)
string(JSON n LENGTH "${trace}" traceEvents)
set(phases "")
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON ph GET "${trace}" traceEvents ${i} ph)
  list(APPEND phases ${ph})
endforeach()
list(FIND phases X has_range)
list(FIND phases C has_counter)
if(has_range LESS 0 OR has_counter LESS 0)
  message(FATAL_ERROR "the trace lacks range (X) or counter (C) events: ${phases}")
endif()
