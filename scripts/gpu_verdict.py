"""The one JSON object scripts/gpu_check.sh prints: each step's result and, per target,
a verdict with the figure it rests on.

    python scripts/gpu_verdict.py DIR DEVICE

DIR holds, per step (``wiring``, ``bench``, ``torch``, ``device_tests``), ``STEP.out`` (its
stdout: one JSON object when it finished), ``STEP.err`` (its stderr), ``STEP.rc`` (its exit
status; 124: killed by ``timeout``) and ``STEP.limit`` (its time limit in seconds). Targets:

* ``restore_vs_pinned_copy``: every service's restore bandwidth is at least 80% of a
  plain pinned host-to-device copy of the same bytes (cuda only; on the cpu device the
  figure, against a host memcpy, is shown without a verdict);
* ``numerics``: torch == numpy on the same weights, the Hugging Face loader in bfloat16
  within tolerance of a float32 reference at long positions, for every DoP tested, and a
  bfloat16 rotary table caught by that comparison;
* ``nvml``: NVML readings and discovery worked (cuda only);
* ``layer_split``: DoP 2/4/8 tested where the machine has the GPUs (the note says what).

``pass`` is true, false, or null (not applicable on this device); ``ok`` is false when
a step failed or a verdict is false. Exit status 0 iff ok.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESTORE_TARGET = 0.8


def step(d: Path, name: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the step's status with the reason of a failure, its JSON output or None)."""
    rc_text = (d / f"{name}.rc").read_text().strip() if (d / f"{name}.rc").exists() else ""
    rc = int(rc_text) if rc_text.lstrip("-").isdigit() else None
    limit = (d / f"{name}.limit").read_text().strip() if (d / f"{name}.limit").exists() else "?"
    err = (d / f"{name}.err").read_text(errors="replace") if (d / f"{name}.err").exists() else ""
    out_text = (d / f"{name}.out").read_text(errors="replace") if (d / f"{name}.out").exists() \
        else ""
    data = None
    for line in reversed(out_text.strip().splitlines()):
        try:
            data = json.loads(line)
            break
        except ValueError:
            continue
    lines = [x for x in err.strip().splitlines() if x.strip()]
    last = lines[-1].strip()[:300] if lines else ""  # a traceback's last line: the error
    if rc is None:
        reason = "did not run"
    elif rc == 124:
        reason = f"timed out after {limit} s" + (f" (last stderr line: {last})" if last else "")
    elif rc != 0:
        reason = f"exit status {rc}: {last}" if last else f"exit status {rc} (no stderr)"
    elif data is None:
        reason = "exit status 0 but no JSON on stdout" + (f" ({last})" if last else "")
    else:
        reason = ""
    status = {"ok": rc == 0 and data is not None, "rc": rc, "reason": reason}
    if reason and lines:
        status["stderr_tail"] = "\n".join(lines[-12:])[-2000:]
    return status, data


def verdicts(device: str, bench: dict | None, bench_why: str, torch: dict | None,
             torch_why: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    # restore bandwidth against a plain pinned copy of the same bytes
    t: dict[str, Any] = {"target": f"restore_gbps p50 >= {RESTORE_TARGET} x plain copy, "
                                   "every service"}
    if bench is None:
        t.update({"pass": False, "reason": f"bench did not finish: {bench_why}"})
    else:
        ratios = {r["service"]: r.get("restore_vs_plain") for r in bench.get("services", [])}
        measured = [v for v in ratios.values() if v is not None]
        t["per_service"] = ratios
        t["value"] = min(measured) if measured else None
        if device != "cuda":
            t.update({"pass": None, "reason": "cpu device: compared with a host memcpy, "
                                             "the target is for a GPU's host-to-device link"})
        elif not measured or len(measured) < len(ratios):
            t.update({"pass": False, "reason": "a service had no measured restore"})
        else:
            ok = min(measured) >= RESTORE_TARGET
            worst = min(ratios, key=lambda k: ratios[k] or 0.0)
            t.update({"pass": ok, "reason": "" if ok else
                      f"{worst}: {ratios[worst]} of the plain copy's bandwidth"})
    out["restore_vs_pinned_copy"] = t
    # numerics
    n: dict[str, Any] = {"target": "torch == numpy; bfloat16 HF within tolerance of a float32 "
                                   "reference at long positions; bfloat16 rotary caught"}
    if torch is None:
        n.update({"pass": False, "reason": f"torch check did not finish: {torch_why}"})
    else:
        tiny, hf = torch.get("tiny", {}), torch.get("hf", {})
        drift = hf.get("rotary_drift", {})
        runs = hf.get("runs", [])
        n.update({"tiny_max_abs_diff": tiny.get("max_abs_diff_numpy_vs_torch"),
                  "hf_max_abs_diff_long": max((r.get("max_abs_diff_long", float("inf"))
                                               for r in runs), default=None),
                  "tolerance": hf.get("tolerance"),
                  "rotary_bf16_detected": drift.get("rotary_bf16_detected")})
        why = []
        if not tiny.get("ok"):
            why.append("torch differs from numpy on the same weights")
        bad = [f"DoP {r['dop']}: {r.get('status')} {r.get('error', '')[:120]}".strip()
               for r in runs if not (r.get("status") == "ok" and r.get("ok"))]
        why += bad
        if not drift.get("ok"):
            why.append("the rotary-drift self-test failed (staged rotary dtypes "
                       f"{drift.get('staged_rotary_dtypes')}, detected: "
                       f"{drift.get('rotary_bf16_detected')})")
        if hf and not hf.get("resident_equals_core", True):
            why.append("the worker's resident set differs from the core's")
        n.update({"pass": not why and bool(hf.get("ok")),
                  "reason": "; ".join(why) or ("" if hf.get("ok") else "hf check failed")})
    out["numerics"] = n
    # NVML
    v: dict[str, Any] = {"target": "NVML readings and discovery"}
    if device != "cuda":
        v.update({"pass": None, "reason": "cpu device: no NVML"})
    elif bench is None:
        v.update({"pass": False, "reason": f"bench did not finish: {bench_why}"})
    elif bench.get("nvml_error"):
        v.update({"pass": False, "reason": bench["nvml_error"]})
    else:
        disc = bench.get("discovery") or {}
        v.update({"pass": bool(bench.get("nvml")) and bool(disc.get("driver")),
                  "driver": disc.get("driver"), "gpus": len(disc.get("gpus", [])),
                  "reason": "" if bench.get("nvml") else "no NVML readings in the bench"})
    out["nvml"] = v
    # layer splits
    s: dict[str, Any] = {"target": "DoP 2/4/8 where the machine has the GPUs"}
    if torch is None:
        s.update({"pass": False, "reason": f"torch check did not finish: {torch_why}"})
    else:
        hf = torch.get("hf", {})
        s.update({"gpus_seen": hf.get("gpus_seen"), "dops_tested": hf.get("dops_tested"),
                  "note": hf.get("layer_split"),
                  "pass": all(r.get("ok") for r in hf.get("runs", []) if r.get("dop", 1) > 1)
                  if hf.get("runs") else False,
                  "reason": "" if hf.get("runs") else "no run of the Hugging Face loader"})
    out["layer_split"] = s
    return out


def main() -> None:
    d, device = Path(sys.argv[1]), sys.argv[2]
    steps, data = {}, {}
    for name in ("wiring", "bench", "torch", "device_tests"):
        steps[name], data[name] = step(d, name)
    targets = verdicts(device, data["bench"], steps["bench"]["reason"], data["torch"],
                       steps["torch"]["reason"])
    ok = all(st["ok"] for st in steps.values()) and \
        all(t.get("pass") is not False for t in targets.values())
    print(json.dumps({"ok": ok, "device": device, "targets": targets, "steps": steps,
                      "bench": data["bench"], "torch": data["torch"]}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
