# The BPE path from a text file to a sample, as a user types it: prepare --tokenizer bpe (the `tokenizers`
# package through scripts/prepare_data.py), train a few steps, generate (the prompt's tokens, encoded by the
# package and decoded by flashlm, give the prompt back byte for byte; the same seed gives the same text);
# and a uint32 token file (vocabulary > 65536) that train reads and checks. Arguments: FLASHLM, PYTHON (with
# tokenizers; also what FLASHLM_PYTHON is set to), SCRIPTS, WORKDIR.
set(dir ${WORKDIR}/text2model_bpe)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(text "")
foreach(i RANGE 80)
  string(APPEND text "Paragraph ${i}: the license grants you the freedom to share and change the work.\n")
endforeach()
file(WRITE ${dir}/text.txt "${text}")
set(ENV{FLASHLM_PYTHON} ${PYTHON})

include(${CMAKE_CURRENT_LIST_DIR}/flashlm_commands.cmake)

run_ok("prepare bpe" prepare ${dir}/text.txt --out ${dir} --tokenizer bpe --vocab-size 300)
if(NOT out MATCHES "tokenizer.json: byte-level BPE, vocabulary ([0-9]+) \\(uint16 token files\\)")
  message(FATAL_ERROR "prepare --tokenizer bpe said the wrong things:\n${out}")
endif()
set(vocab ${CMAKE_MATCH_1})
if(NOT vocab EQUAL 300)
  message(FATAL_ERROR "the BPE has ${vocab} tokens, asked for 300:\n${out}")
endif()
file(SIZE ${dir}/text.txt text_bytes)
file(SIZE ${dir}/train.bin train_bytes)
if(NOT train_bytes LESS text_bytes)  # 2 bytes a token: merges must have shortened the text by half or more
  message(FATAL_ERROR "BPE tokens (${train_bytes} bytes) did not compress the ${text_bytes}-byte text")
endif()
file(READ ${dir}/tokenizer.json tokenizer)
string(JSON model_type GET "${tokenizer}" model type)
if(NOT model_type STREQUAL "BPE")
  message(FATAL_ERROR "tokenizer.json is not the tokenizers package's BPE: model.type ${model_type}")
endif()

set(train_args --device cpu --data ${dir}/train.bin --val-data ${dir}/val.bin --vocab 300 --model tiny --context 64
               --batch 4 --eval-every 0 --eval-batches 1)
run_ok("train on bpe" train ${train_args} --steps 4 --log-every 2 --checkpoint ${dir}/run.ckpt)
set(prompt "Paragraph 7: the license, \u00e9t\u00e9 \u65e5\u672c")  # non-ASCII: bytes merged across characters
set(sample --checkpoint ${dir}/run.ckpt --tokenizer ${dir}/tokenizer.json --prompt "${prompt}" --max-tokens 8
           --temperature 0.9 --top-k 20 --seed 3)
run_ok("generate bpe" generate ${sample})
set(first "${out}")
string(LENGTH "${prompt}" n)
string(SUBSTRING "${first}" 0 ${n} echoed)
if(NOT echoed STREQUAL prompt)
  message(FATAL_ERROR "the prompt did not survive encode (tokenizers) + decode (flashlm):\n${prompt}\n${first}")
endif()
run_ok("generate bpe again" generate ${sample})
if(NOT out STREQUAL first)
  message(FATAL_ERROR "the same seed gave two samples:\n${first}\n${out}")
endif()

# --out is created with its parents, as on the byte path.
run_ok("prepare bpe --out new/data" prepare ${dir}/text.txt --out ${dir}/new/data --tokenizer bpe --vocab-size 300)
if(NOT EXISTS ${dir}/new/data/tokenizer.json)
  message(FATAL_ERROR "prepare --tokenizer bpe did not create --out ${dir}/new/data:\n${out}")
endif()
expect_exit(2 "--tokenizer bpe needs a vocabulary size" prepare ${dir}/text.txt --out ${dir} --tokenizer bpe)
expect_exit(2 "--vocab-size" prepare ${dir}/text.txt --out ${dir} --tokenizer bpe --vocab-size 255)
expect_exit(2 "--vocab-size is for --tokenizer bpe" prepare ${dir}/text.txt --out ${dir} --vocab-size 300)
expect_exit(2 "--tokenizer" prepare ${dir}/text.txt --out ${dir} --tokenizer wordpiece)
expect_exit(1 "'${dir}/missing.txt': cannot open" prepare ${dir}/missing.txt --out ${dir} --tokenizer bpe --vocab-size 300)
# A prompt that is not UTF-8 has no tokens in the `tokenizers` package: a clear error, from flashlm and from the
# script alike, not a traceback.
string(ASCII 255 not_utf8)
expect_exit(2 "--prompt: byte 1 is not valid UTF-8" generate --checkpoint ${dir}/run.ckpt --tokenizer ${dir}/tokenizer.json
            --prompt "a${not_utf8}b")
execute_process(COMMAND ${PYTHON} ${SCRIPTS}/prepare_data.py encode --tokenizer ${dir}/tokenizer.json "a${not_utf8}b"
                RESULT_VARIABLE rc ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 2 OR NOT err MATCHES "^error: the text to encode is not valid UTF-8" OR err MATCHES "Traceback")
  message(FATAL_ERROR "prepare_data.py encode of bytes that are not UTF-8: exit ${rc}\nstderr: ${err}")
endif()
expect_exit(2 "the model's vocabulary is 300, the byte tokenizer's 256" generate --checkpoint ${dir}/run.ckpt --prompt a)
execute_process(COMMAND ${CMAKE_COMMAND} -E env FLASHLM_PYTHON=${dir}/no-python ${FLASHLM} prepare ${dir}/text.txt
                        --out ${dir} --tokenizer bpe --vocab-size 300
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 1 OR NOT err MATCHES "^error: cannot run '.*no-python'.*setup-tokenizers.sh")
  message(FATAL_ERROR "a missing FLASHLM_PYTHON: exit ${rc}\nstderr: ${err}")
endif()

# The script writes its three files as one set, as the C++ side does: with files limited to 1000 bytes (a full
# disk, without root), the second fails and the first keeps its old bytes; no temporary is left.
file(WRITE ${dir}/set/a "old a")
file(WRITE ${dir}/set/b "old b")
execute_process(COMMAND ${PYTHON} -c "import os, resource, signal, sys; sys.path.insert(0, sys.argv[1]); import prepare_data
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
d = sys.argv[2]
try:
    prepare_data.write_together({d + '/a': b'n' * 1000, d + '/b': b'n' * 1001, d + '/c': b'n'})
    sys.exit('the oversized file was written')
except OSError:
    pass
print(open(d + '/a').read(), open(d + '/b').read(), sorted(os.listdir(d)))" ${SCRIPTS} ${dir}/set
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT out STREQUAL "old a old b ['a', 'b']\n")
  message(FATAL_ERROR "prepare_data.py's write of a dataset that fails part way: exit ${rc}\n${out}${err}")
endif()

# Ids beyond uint16, written as prepare_data.py writes a vocabulary > 65536, read back by train.
execute_process(COMMAND ${PYTHON} -c "import sys; sys.path.insert(0, sys.argv[1]); import prepare_data
ids = [65530 + (i * 7) % 19 for i in range(400)]
open(sys.argv[2], 'wb').write(prepare_data.token_file_bytes(ids, 70000))" ${SCRIPTS} ${dir}/wide.bin
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "writing a uint32 token file failed")
endif()
file(SIZE ${dir}/wide.bin wide_bytes)
if(NOT wide_bytes EQUAL 2624)  # 1024 header bytes + 400 x 4
  message(FATAL_ERROR "the uint32 token file has ${wide_bytes} bytes, expected 2624")
endif()
run_ok("train on uint32 tokens" train --device cpu --data ${dir}/wide.bin --vocab 70000 --model tiny --context 16
       --batch 2 --steps 1 --eval-every 0)
expect_exit(1 "token 65544 at position 2 is outside the vocabulary \\(vocab_size = 65540\\)"
            train --device cpu --data ${dir}/wide.bin --vocab 65540 --model tiny --context 16 --batch 2 --steps 1
            --eval-every 0)
