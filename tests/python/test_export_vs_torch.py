"""From text to the same logits in PyTorch, through the CLI as a user runs it: flashlm prepare, train, export
and generate; the exported safetensors file loads into the CS336 PyTorch model (examples/load_in_pytorch.py's) with
load_state_dict(strict=True), and its logits over the generated text match the ones generate drew from."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from test_lm_vs_torch import rel  # noqa: E402
from load_in_pytorch import LM, read_safetensors_by_hand  # noqa: E402  (examples/, put on the path by test_lm_vs_torch)

CLI = os.environ.get("FLASHLM_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="FLASHLM_CLI (the flashlm command) not set")

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

    tensors, meta = read_safetensors_by_hand(tmp_path / "model.safetensors")  # the bytes themselves
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


def test_the_load_in_pytorch_example_runs_on_an_export(tmp_path):
    """examples/load_in_pytorch.py as docs/usage.md runs it, on a freshly exported tiny model: its logits are
    the PyTorch model's after the prompt (whichever reader it took, the safetensors package or its own)."""
    text = "".join(f"Line {i}: a short text for the example.\n" for i in range(40))
    (tmp_path / "text.txt").write_text(text)
    data = tmp_path / "data"  # made by prepare
    flashlm("prepare", tmp_path / "text.txt", "--out", data)
    flashlm("train", "--device", "cpu", "--data", data / "train.bin", "--vocab", 256, "--model", "tiny",
            "--context", 32, "--batch", 2, "--steps", 2, "--eval-every", 0, "--checkpoint", data / "run.ckpt")
    flashlm("export", data / "run.ckpt", data / "model.safetensors")
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "load_in_pytorch.py")
    out = subprocess.run([sys.executable, example, data / "model.safetensors", "--prompt", "Line 3"], check=True,
                         capture_output=True, text=True).stdout
    assert "logits of the next token: shape (256,)" in out
    printed = torch.tensor([float(x) for x in out.rsplit("logits ", 1)[1].split()])
    tensors, meta = read_safetensors_by_hand(data / "model.safetensors")
    model = LM(256, int(meta["flashlm.d_model"]), int(meta["flashlm.d_ff"]), int(meta["flashlm.layers"]),
               int(meta["flashlm.heads"]), float(meta["flashlm.rope_theta"]), float(meta["flashlm.norm_eps"]))
    model.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        want = model(torch.tensor([list(b"Line 3")]))[0, -1]
    assert rel(printed, want) < 1e-6
