"""From text to the same logits in PyTorch, through the CLI as a user runs it: flashlm prepare, train, export
and generate; the exported safetensors file loads into the CS336 PyTorch model (test_lm_vs_torch.py's) with
load_state_dict(strict=True), and its logits over the generated text match the ones generate drew from."""
import json
import os
import struct
import subprocess

import pytest

torch = pytest.importorskip("torch")

from test_lm_vs_torch import LM, rel  # noqa: E402  (the PyTorch model the project already tests against)

CLI = os.environ.get("FLASHLM_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="FLASHLM_CLI (the flashlm command) not set")

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def load_safetensors(path):
    """The format read by hand (8-byte length, JSON header, raw little-endian data), so that the test needs
    no safetensors package and checks the bytes themselves."""
    blob = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8: 8 + n])
    metadata = header.pop("__metadata__", {})
    data = blob[8 + n:]
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        tensors[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[t["dtype"]]).view(t["shape"])
    return tensors, metadata


def flashlm(*args):
    return subprocess.run([CLI, *map(str, args)], check=True, capture_output=True).stdout


def test_exported_model_gives_the_same_logits_in_pytorch(tmp_path):
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(120))
    (tmp_path / "text.txt").write_text(text)
    flashlm("prepare", tmp_path / "text.txt", "--out", tmp_path)
    flashlm("train", "--device", "cpu", "--data", tmp_path / "train.bin", "--val-data", tmp_path / "val.bin",
            "--vocab", 256, "--model", "tiny", "--context", 48, "--batch", 4, "--steps", 20, "--eval-every", 0,
            "--checkpoint", tmp_path / "run.ckpt")
    flashlm("export", tmp_path / "run.ckpt", tmp_path / "model.safetensors")
    prompt, new = b"Line 7: the ", 30
    # From the training checkpoint, so that flashlm's logits owe nothing to the exported file.
    out = flashlm("generate", "--checkpoint", tmp_path / "run.ckpt", "--tokenizer", tmp_path / "tokenizer.json",
                  "--prompt", prompt.decode(), "--max-tokens", new, "--temperature", 0,
                  "--logits-out", tmp_path / "logits.bin")
    assert out.endswith(b"\n") and out.startswith(prompt)
    tokens = list(out[:-1])
    assert len(tokens) == len(prompt) + new

    tensors, meta = load_safetensors(tmp_path / "model.safetensors")
    model = LM(int(meta["flashlm.vocab"]), int(meta["flashlm.d_model"]), int(meta["flashlm.d_ff"]),
               int(meta["flashlm.layers"]), int(meta["flashlm.heads"]), float(meta["flashlm.rope_theta"]),
               float(meta["flashlm.norm_eps"]))
    model.load_state_dict(tensors, strict=True)  # every name and shape of the PyTorch model, nothing else
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]))[0]  # position t predicts token t + 1
    theirs = logits[len(prompt) - 1:]
    ours = torch.frombuffer(bytearray((tmp_path / "logits.bin").read_bytes()), dtype=torch.float32).view(new, 256)
    assert rel(ours, theirs) < 1e-5, f"relative error {rel(ours, theirs):.2e}"
    # Greedy decoding took PyTorch's most likely token at every step.
    assert theirs.argmax(-1).tolist() == tokens[len(prompt):]
