#!/usr/bin/env python3
"""The per-ISA copies of the CPU attention kernels share no vector code with the baseline path.

The linker keeps one copy of each inline (weak, COMDAT) function of a given name for the whole library. A copy
compiled with -march=x86-64-v4 inside the AVX-512 kernels' object could therefore be the one the baseline
kernels call, and crash a CPU without AVX-512. attention/flash_cpu.cpp keeps its helpers in a namespace per
ISA; this check disassembles every weak function an ISA object still defines outside that namespace and fails
if one uses an instruction beyond baseline x86-64 (VEX/EVEX, mask registers, BMI, LZCNT, POPCNT, MOVBE).

usage: check_cpu_kernel_objects.py OBJDUMP NM OBJECT...   (the objects of the non-baseline variants)
"""
import re
import subprocess
import sys

BEYOND_BASELINE = re.compile(r"^(v[a-z0-9]+|k[a-z]+|shlx|sarx|shrx|rorx|andn|bzhi|pdep|pext|blsi|blsr|blsmsk|"
                             r"tzcnt|lzcnt|popcnt|movbe)$")


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    objdump, nm, objects = sys.argv[1], sys.argv[2], sys.argv[3:]
    bad = []
    for obj in objects:
        isa_ns = re.search(r"flashlm_cpu_kernels_(\w+)\.dir", obj)
        own = f"flashlm::cpu_{isa_ns.group(1)}::" if isa_ns else None
        symbols = subprocess.run([nm, "--defined-only", "-C", obj], check=True, capture_output=True, text=True)
        weak = {line.split(" ", 2)[2] for line in symbols.stdout.splitlines() if line.split(" ")[1:2] == ["W"]}
        shared = {name for name in weak if not (own and own in name.split("(")[0])}
        dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", obj], check=True, capture_output=True,
                             text=True).stdout
        for block in re.split(r"\n(?=[0-9a-f]+ <)", dis):
            head = re.match(r"[0-9a-f]+ <(.*)>:", block)
            if not head or head.group(1) not in shared:
                continue
            for line in block.splitlines()[1:]:
                fields = line.split("\t")
                mnemonic = fields[-1].split()[0] if len(fields) > 1 and fields[-1].split() else ""
                if BEYOND_BASELINE.match(mnemonic):
                    bad.append(f"{obj}: {head.group(1)}: {fields[-1].strip()}")
                    break
        print(f"{obj}: {len(shared)} shared weak function(s) checked")
    if bad:
        print("shared inline functions compiled beyond baseline x86-64 (move them into the ISA namespace or "
              "out of line):\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
