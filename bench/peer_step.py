#!/usr/bin/python3
"""bench/peer_step: shoestring's training step against a PyTorch eager peer doing the same work, in one run.

For each row (architecture, resolution, batch, dtype, optimizer, fused or not) this runs, alternately and
several times (rounds; shoestring first in odd rounds, the peer first in even ones), build/bench/model_step
and bench/peer_torch.py with the same arguments, each in its own process. It prints the median of the
steady-state step times (every step of a process but its first, which includes one-time allocations) of
each side and their ratio, and the peak resident memory of each side's processes (ru_maxrss from wait4,
the highest over the rounds) and its ratio. The first line is the machine line of the C++ benches
(bench/bench_machine.h, printed by `model_step --machine`: CPU model, features, bf16 units, OpenMP wait policy,
BLAS kernels).

Same work on both sides: the architecture and its parameter count, random inputs of the same shapes
(LDM latents [B,4,R/8,R/8], 77 text tokens, SDXL's y; the emoji example's UNet on pixels [B,3,R,R] with
16 caption tokens of width 256), MSE of the fp32 output against the latent input, backward, the
optimizer (Adafactor with kohya's arguments or AdamW, lr 1e-5), gradient checkpointing per ResBlock
and transformer block, the same intra-op thread count (every CPU of the affinity mask) and the same
OMP_WAIT_POLICY and GOMP_SPINCOUNT (PASSIVE and 3000 unless set, as shoestring sets them for itself:
core/threads.h), and the same OpenBLAS kernels (OPENBLAS_CORETYPE where OpenBLAS fell back to generic ones
on a CPU it does not know, as shoestring sets it for itself). bf16 rows (bf16 weights with
stochastic rounding) run only where /proc/cpuinfo has avx512_bf16 or amx_bf16; rows whose weights and
gradients would not fit in MemAvailable are skipped with the reason printed.

Usage (from the repository root, after scripts/build.sh model_step):
  /usr/bin/python3 bench/peer_step.py --quick            # tiny widths, about a minute: checks the setup
  /usr/bin/python3 bench/peer_step.py                    # the full table (long: see docs/benchmarks.md)
  /usr/bin/python3 bench/peer_step.py --rows sd15-256 --rounds 3 --json out.jsonl
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(ROOT, "bench", "peer_torch.py")


def ours_machine(model_step, env):
    """shoestring's machine line and its JSON form (`model_step --machine`, bench/bench_machine.h): the CPU, its
    features and the runtime settings shoestring gives itself in this environment (core/threads.h)."""
    def run(extra):
        r = subprocess.run([model_step, "--machine", *extra], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"peer_step: {model_step} --machine {' '.join(extra)}: exit {r.returncode}\n{r.stderr[-2000:]}")
        return r.stdout.strip().splitlines()[0]
    return run([]), json.loads(run(["--json"]))


def openblas_corename_unset():
    """The kernel set OpenBLAS picks without OPENBLAS_CORETYPE (asked in a child: OpenBLAS reads the environment
    once, when loaded); "" without OpenBLAS."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    code = "import ctypes; l = ctypes.CDLL('libopenblas.so.0'); l.openblas_get_corename.restype = ctypes.c_char_p; " \
           "print(l.openblas_get_corename().decode())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def emoji_unet(config):
    """The emoji example's UNet widths: the [model] section of `config`, defaults of train/config.h."""
    u = {"base_channels": 64, "channel_mult": [1, 2, 4], "num_res_blocks": 2, "attention_levels": [1, 2],
         "num_heads": 4, "text_dim": 256, "norm_groups": 32, "pooled_context": True, "scale_shift_norm": True,
         "max_caption_length": 16, "resolution": 16, "train_batch_size": 32}
    if tomllib is not None:
        with open(config, "rb") as f:
            c = tomllib.load(f)
        u.update({k: v for k, v in c.get("model", {}).items() if k in u})
        u.update({k: v for k, v in c.items() if k in ("max_caption_length", "resolution", "train_batch_size")})
    widths = {"base_channels": u["base_channels"], "channel_mult": u["channel_mult"],
              "num_res_blocks": u["num_res_blocks"], "attention_levels": u["attention_levels"],
              "num_heads": u["num_heads"], "context_dim": u["text_dim"], "groups": u["norm_groups"],
              "pooled_context": u["pooled_context"], "scale_shift_norm": u["scale_shift_norm"],
              "context_tokens": u["max_caption_length"]}
    return widths, u["resolution"], u["train_batch_size"]


def make_rows(args, bf16_units):
    emoji_cfg = os.path.join(ROOT, "examples", "emoji.toml")
    widths, emoji_res, emoji_batch = emoji_unet(emoji_cfg)
    rows = []

    def add(name, arch, res, batch, opt, ckpt, steps, rounds, tiny=False, params_estimate=0):
        for dtype in (["fp32", "bf16"] if bf16_units else ["fp32"]):
            for fused in (True, False):
                rows.append(dict(name=name, arch=arch, tiny=tiny, resolution=res, batch=batch, dtype=dtype,
                                 optimizer=opt, checkpointing=ckpt, fused=fused, steps=steps, rounds=rounds,
                                 params=params_estimate, config=emoji_cfg, tiny_unet=widths))

    if args.quick:
        add("emoji", "tiny-unet", emoji_res, 4, "AdamW", False, 4, 2, params_estimate=4.2e6)
        add("sd15-tiny-64", "sd15", 64, 1, "Adafactor", True, 4, 2, tiny=True, params_estimate=8.6e6)
        add("sdxl-tiny-64", "sdxl", 64, 1, "Adafactor", True, 4, 2, tiny=True, params_estimate=23.4e6)
    else:
        add("emoji", "tiny-unet", emoji_res, emoji_batch, "AdamW", False, 11, 3, params_estimate=4.2e6)
        add("sd15-256", "sd15", 256, 1, "Adafactor", True, 3, 2, params_estimate=859.5e6)
        add("sd15-512", "sd15", 512, 1, "Adafactor", True, 2, 2, params_estimate=859.5e6)
        add("sdxl-512", "sdxl", 512, 1, "Adafactor", True, 2, 2, params_estimate=2567.5e6)
    if args.rows:
        wanted = {name.strip() for name in args.rows.split(",") if name.strip()}
        if not wanted:
            sys.exit(f"peer_step: --rows {args.rows!r} names no row")
        known = sorted({r["name"] for r in rows})
        unknown = sorted(wanted - set(known))
        if unknown:
            sys.exit(f"peer_step: unknown row(s) {', '.join(unknown)}{' with --quick' if args.quick else ''}; "
                     f"rows: {', '.join(known)}")
        rows = [r for r in rows if r["name"] in wanted]
    if args.dtype:
        if args.dtype == "bf16" and not bf16_units:
            sys.exit("peer_step: --dtype bf16: this CPU has no bf16 units (avx512_bf16 / amx_bf16), so there are "
                     "no bf16 rows")
        rows = [r for r in rows if r["dtype"] == args.dtype]
    if args.fused:
        rows = [r for r in rows if r["fused"] == (args.fused == "yes")]
    for r in rows:
        if args.rounds:
            r["rounds"] = args.rounds
        if args.steps:
            r["steps"] = args.steps
    return rows


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def commands(row, model_step):
    common = ["--resolution", str(row["resolution"]), "--batch", str(row["batch"]), "--steps", str(row["steps"]),
              "--optimizer", row["optimizer"]]
    flags = []
    if not row["checkpointing"]:
        flags.append("--no-checkpointing")
    if not row["fused"]:
        flags.append("--no-fused")
    if row["dtype"] == "fp32":
        flags.append("--fp32")
    if row["tiny"]:
        flags.append("--tiny")
    ours = [model_step, "--arch", row["arch"], *common, *flags, "--json"]
    peer = [sys.executable, PEER, "--arch", row["arch"], *common, *flags]
    if row["arch"] == "tiny-unet":
        ours += ["--config", row["config"]]
        peer += ["--tiny-unet", json.dumps(row["tiny_unet"])]
    return ours, peer


def run_one(cmd, env):
    """Runs cmd; returns (last JSON object on stdout with step_seconds, peak RSS bytes, seconds, stderr tail)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        result = None
        for line in out.read().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    j = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "step_seconds" in j:
                    result = j
        code = os.waitstatus_to_exitcode(status)
        tail = err.read()[-2000:]
        if code != 0 or result is None:
            raise RuntimeError(f"{' '.join(cmd)}: exit {code}\n{tail}")
        return result, usage.ru_maxrss * 1024, wall


def gib(b):
    return f"{b / 2**30:.2f}"


def main():
    ap = argparse.ArgumentParser(description="shoestring vs a PyTorch eager peer, one training step")
    ap.add_argument("--quick", action="store_true", help="tiny widths (checks the setup in about a minute)")
    ap.add_argument("--rows", default="", help="comma-separated row names (emoji, sd15-256, sd15-512, sdxl-512; "
                    "quick: emoji, sd15-tiny-64, sdxl-tiny-64)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="", help="only the rows of this dtype")
    ap.add_argument("--fused", choices=["yes", "no"], default="", help="only the fused (or unfused) rows")
    ap.add_argument("--rounds", type=int, default=0, help="alternations per row (default: per row)")
    ap.add_argument("--steps", type=int, default=0, help="steps per process, first one not counted (default: per row)")
    ap.add_argument("--build-dir", default=os.environ.get("SHOESTRING_BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--json", default="", help="append one JSON object per row to this file")
    ap.add_argument("--peer-default-blas", action="store_true",
                    help="the peer runs the OpenBLAS kernels OpenBLAS picks itself (what a PyTorch user gets), "
                         "not the ones shoestring asks for")
    args = ap.parse_args()
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 1 (or 0 for the row's default), got {args.rounds}")
    if args.steps != 0 and args.steps < 2:
        ap.error(f"--steps must be >= 2 (the first step of each process is not counted), got {args.steps}")
    env = dict(os.environ)
    env_at_start = dict(env)
    if not env.get("OMP_WAIT_POLICY"):
        # what shoestring sets for itself (core/threads.h); the peer gets the same
        for key, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "3000")):
            if not env.get(key):
                env[key] = value
                os.environ[key] = value
    model_step = os.path.join(args.build_dir, "bench", "model_step")
    if not os.access(model_step, os.X_OK):
        sys.exit(f"peer_step: {model_step} not found; build it with scripts/build.sh model_step")
    line, machine = ours_machine(model_step, env)
    bf16_units = machine["bf16_units"]
    if "OPENBLAS_CORETYPE" not in env and machine["blas"].endswith(" (OPENBLAS_CORETYPE)"):
        # OpenBLAS kernels shoestring set for itself (OpenBLAS did not know the CPU): the peer gets the same
        # (unset, a peer on such a CPU runs OpenBLAS's generic fallback)
        env["OPENBLAS_CORETYPE"] = machine["blas"].split()[1]
        os.environ["OPENBLAS_CORETYPE"] = env["OPENBLAS_CORETYPE"]
    peer_env = dict(env)
    if args.peer_default_blas and "OPENBLAS_CORETYPE" in env and "OPENBLAS_CORETYPE" not in env_at_start:
        del peer_env["OPENBLAS_CORETYPE"]
        line += f" (the peer: OpenBLAS {openblas_corename_unset() or 'unknown'}, its own pick)"
    print(line, flush=True)
    threads = len(os.sched_getaffinity(0))
    print(f"threads: {threads} on both sides; peer: {sys.executable} (torch, eager)", flush=True)
    rows = make_rows(args, bf16_units)
    if not bf16_units:
        print("bf16 rows skipped: this CPU has no bf16 units (avx512_bf16 / amx_bf16)", flush=True)
    header = (f"{'row':<14} {'res':>4} {'B':>3} {'dtype':<5} {'optimizer':<9} {'fused':<5} "
              f"{'ours s/step':>11} {'peer s/step':>11} {'ratio':>6} {'ours GiB':>8} {'peer GiB':>8} {'ratio':>6}")
    results = []
    for row in rows:
        ours_cmd, peer_cmd = commands(row, model_step)
        bytes_per = 2 if row["dtype"] == "bf16" else 4
        need = row["params"] * bytes_per * (1 if row["fused"] else 2) * 1.15 + 2 * 2**30
        if need > mem_available():
            print(f"{row['name']} {row['dtype']} {'fused' if row['fused'] else 'unfused'}: skipped, weights"
                  f"{'' if row['fused'] else ' + gradients'} need ~{gib(need)} GiB > MemAvailable "
                  f"{gib(mem_available())} GiB", flush=True)
            continue
        print(f"# {row['name']}: ours: {' '.join(ours_cmd)}\n#   peer: {' '.join(peer_cmd)}", flush=True)
        steps = {"ours": [], "peer": []}
        rss = {"ours": 0, "peer": 0}
        params = {}
        for rnd in range(row["rounds"]):
            order = [("ours", ours_cmd), ("peer", peer_cmd)]
            if rnd % 2:
                order.reverse()
            for side, cmd in order:
                j, peak, wall = run_one(cmd, env if side == "ours" else peer_env)
                steps[side] += j["step_seconds"][1:] if len(j["step_seconds"]) > 1 else j["step_seconds"]
                rss[side] = max(rss[side], peak)
                params[side] = j["parameters"]
                print(f"#   round {rnd + 1} {side}: steps {', '.join(f'{s:.3f}' for s in j['step_seconds'])} s, "
                      f"peak RSS {gib(peak)} GiB, {wall:.0f} s wall", flush=True)
        if params["ours"] != params["peer"]:
            print(f"#   WARNING: parameter counts differ: ours {params['ours']}, peer {params['peer']}", flush=True)
        ours_s, peer_s = statistics.median(steps["ours"]), statistics.median(steps["peer"])
        r = dict(row=row["name"], arch=row["arch"] + (" (tiny)" if row["tiny"] else ""),
                 resolution=row["resolution"], batch=row["batch"], dtype=row["dtype"], optimizer=row["optimizer"],
                 checkpointing=row["checkpointing"], fused=row["fused"], parameters=params["ours"],
                 peer_parameters=params["peer"], rounds=row["rounds"], steps_per_process=row["steps"],
                 ours_step_seconds=steps["ours"], peer_step_seconds=steps["peer"], ours_median_s=ours_s,
                 peer_median_s=peer_s, time_ratio=ours_s / peer_s, ours_peak_rss_bytes=rss["ours"],
                 peer_peak_rss_bytes=rss["peer"], rss_ratio=rss["ours"] / rss["peer"], cpu=line, threads=threads)
        results.append(r)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
        print(header, flush=True)
        print(format_row(r), flush=True)
    print("\n" + line)
    print(header)
    for r in results:
        print(format_row(r))
    if not results:
        sys.exit("peer_step: no row ran (every selected row was skipped: see above)")


def format_row(r):
    return (f"{r['row']:<14} {r['resolution']:>4} {r['batch']:>3} {r['dtype']:<5} {r['optimizer']:<9} "
            f"{'yes' if r['fused'] else 'no':<5} {r['ours_median_s']:>11.3f} {r['peer_median_s']:>11.3f} "
            f"{r['time_ratio']:>6.2f} {gib(r['ours_peak_rss_bytes']):>8} {gib(r['peer_peak_rss_bytes']):>8} "
            f"{r['rss_ratio']:>6.2f}")


if __name__ == "__main__":
    main()
