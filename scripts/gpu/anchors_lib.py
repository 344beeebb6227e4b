"""What the side-by-side scripts beside anchors.py share (anchors_mtp.py, anchors_fp8q.py).

anchors.py (from ../shared/bench, copied into the folder fetch-anchors.sh fills) holds the
loaders of the anchors, the case generator, the reference, the timing (median of CUDA-graph
replays) and the ceilings; these helpers load it and time a case's implementations with it.
"""
import argparse, importlib.util, math, os


def load_anchors(ref):
    """anchors.py of the folder `ref`, as a module."""
    spec = importlib.util.spec_from_file_location("anchors", os.path.join(ref, "anchors.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def setup():
    """The command line (--ref, --out) and anchors.py of --ref: (args, module)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="the folder of fetch-anchors.sh, with anchors.py copied in")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    return a, load_anchors(a.ref)


def measure(A, impls, n, ro, rl):
    """Each (name, make) of `impls`: make() gives (fn, o, lse, ...), or None to skip. Returns
    {name: dict(us, err_o, err_lse)} against the reference's first n rows, or dict(error)."""
    out = {}
    for name, mk in impls:
        try:
            r = mk()
            if r is None:
                continue
            fn, o, lse = r[:3]
            out[name] = dict(us=A.timed(fn) * 1e3, err_o=A.rel_err(o[:n], ro), err_lse=A.rel_err(lse[:n], rl))
        except Exception as e:  # noqa
            out[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    return out


def cells(row, names):
    """One printed line's timings of `names` in `row`."""
    return "  ".join(f"{k}={row[k]['us']:.1f}us(err {row[k]['err_o']:.1e})" if "us" in row[k]
                     else f"{k}=ERR {row[k]['error'][:80]}" for k in names if k in row)


def ok(row, name):
    return name in row and "us" in row[name]


def summary(ratios, what):
    """The geometric mean, min and max of speed ratios (> 1: ours faster), as a line."""
    if not ratios:
        return f"{what}: no case"
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{what}: geomean {gm:.2f}x over {len(ratios)} cases, min {min(ratios):.2f}x, max {max(ratios):.2f}x"
