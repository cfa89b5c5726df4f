# --model-config as a user gives it (issue 34): the file's "vocab" and "context" hold unless --vocab/--context
# are given, which then win with a line saying so; a FIFO is refused at once instead of blocking the read.
# Arguments: FLASHLM, WORKDIR.
include(${CMAKE_CURRENT_LIST_DIR}/flashlm_commands.cmake)
set(dir ${WORKDIR}/cli_model_config)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(train_args train --device cpu --steps 1 --batch 1 --eval-batches 1 --threads 1)

# tiny's parameters: 64 per vocabulary entry (embedding and head) + 20640 in the blocks and the final norm.
file(WRITE ${dir}/sized.json "{\"base\": \"tiny\", \"vocab\": 1000, \"context\": 128}")
run_ok("the file's vocab and context" ${train_args} --model-config ${dir}/sized.json)
if(NOT out MATCHES "model: 84640 parameters" OR NOT out MATCHES "batch 1 x 128 tokens")
  message(FATAL_ERROR "--model-config's vocab 1000 and context 128 were not the model's:\n${out}")
endif()
if(err MATCHES "--vocab|--context")
  message(FATAL_ERROR "a note about --vocab/--context that were not given:\n${err}")
endif()

run_ok("--vocab and --context over the file's" ${train_args} --model-config ${dir}/sized.json --vocab 300 --context 32)
if(NOT out MATCHES "model: 39840 parameters" OR NOT out MATCHES "batch 1 x 32 tokens")
  message(FATAL_ERROR "--vocab 300 --context 32 did not win over the file's:\n${out}")
endif()
if(NOT err MATCHES "--vocab 300 replaces the model config's \"vocab\": 1000"
   OR NOT err MATCHES "--context 32 replaces the model config's \"context\": 128")
  message(FATAL_ERROR "no line saying which of the flag and the file won:\n${err}")
endif()

# Without the keys in the file the flags' defaults hold, as before (vocab 256, context 64).
file(WRITE ${dir}/base.json "{\"base\": \"tiny\"}")
run_ok("the flags' defaults" ${train_args} --model-config ${dir}/base.json)
if(NOT out MATCHES "model: 37024 parameters" OR NOT out MATCHES "batch 1 x 64 tokens")
  message(FATAL_ERROR "a file without vocab and context did not take --vocab/--context's defaults:\n${out}")
endif()

# bench: the file's context instead of --context's default.
run_ok("bench with the file's context" bench --device cpu --model-config ${dir}/sized.json --batch 1 --pass fwd
       --warmup 0 --steps 1 --format csv --quiet --threads 1)
if(NOT out MATCHES ",128,")
  message(FATAL_ERROR "bench --model-config did not run the file's context 128:\n${out}")
endif()

# A FIFO with no writer: a clear usage error at once (TIMEOUT in expect_exit ends a hung read).
execute_process(COMMAND mkfifo ${dir}/fifo.json RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mkfifo failed: ${rc}")
endif()
set(refused "model config: '.*fifo.json': not a regular file \\(a FIFO\\)")
expect_exit(2 "${refused}" ${train_args} --model-config ${dir}/fifo.json)
expect_exit(2 "${refused}" bench --device cpu --model-config ${dir}/fifo.json)
