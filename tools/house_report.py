"""The "house" numbers of a tree (issue 52): file and class sizes, imports against the layer order, settings copied by
hand, figures and section references in the code, the size of the record, and what benchmarks/ holds.

    python3 tools/house_report.py [ROOT] [--json]

ROOT defaults to the repository holding this file. Only ast, tokenize and regular expressions: nothing of ROOT is
imported, except the CLI's parser, built in a child process to count its destinations."""
from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

MAX_FILE_LINES = 500
MAX_CLASS_METHODS = 25
TOP = 5
# The layers of oled/, lowest first: a module may import its own layer and those below it, never one above. A
# prefix names a package or a module; the longest matching prefix decides. The package root `oled` (its version and
# public re-exports) is no layer and may be imported from anywhere.
LAYERS = (
    ("base", ("oled.config", "oled.env", "oled.textfile", "oled.tokenizer", "oled.bounds", "oled.fp8")),
    ("kernels", ("oled.kernels",)),
    ("models", ("oled.models",)),
    ("policies", ("oled.policies",)),
    ("runtime", ("oled.runtime",)),
    ("loading", ("oled.loader", "oled.host_memory", "oled.synth")),
    ("decoding", ("oled.decoding",)),
    ("trace", ("oled.trace",)),
    ("engine", ("oled.engine", "oled.llm")),
    ("bench", ("oled.bench", "oled.data")),
    ("front", ("oled.server", "oled.train")),
    ("cli", ("oled.cli",)),
)
# Deferred imports that defer an optional dependency (one of pyproject's extras, what they bring, or readline,
# which some platforms lack), or an oled module that imports one at its top (the Triton kernels, the server's app);
# the other deferrals must say which import cycle they break with a trailing `# cycle: ...` comment.
OPTIONAL = {"triton", "matplotlib", "fastapi", "starlette", "uvicorn", "h11", "pydantic", "prometheus_client",
            "schemathesis", "readline"}
CYCLE_COMMENT = re.compile(r"#\s*cycle:")
TRITON_MODULE = re.compile(r"^oled\.kernels\.(triton_\w+|\w+_kernel)$")
FIGURE = re.compile(r"\d[\d,.]*[  ]?(?:ms|µs|us|ns|[GMT]i?B/s|tok/s|TFLOP/s)\b|\d[\d,.]*[  ]?[x×] (?:faster|slower)")
SECTION_REF = re.compile(r"\b[Ss]ection \d+|§\s?\d+|BENCHMARKS")
NUMBERED_SECTION = re.compile(r"\b[Ss]ections? \d+|§\s?\d+")   # the README may link BENCHMARKS.md, not cite its sections
ONE_LINER = re.compile(r"\bpython3? -c\b")
SCRIPT_SUFFIXES = (".py", ".sh")
SETTING_HOLDERS = {"args", "cfg", "c", "config"}     # `name=args.name`: a setting passed on by hand


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (rank, p)
    return best and best[0]


def python_files(root: Path) -> list[tuple[Path, str, ast.Module]]:
    out = []
    for p in sorted((root / "oled").rglob("*.py")):
        text = p.read_text(encoding="utf-8")
        out.append((p.relative_to(root), text, ast.parse(text, str(p))))
    return out


def module_name(rel: Path) -> tuple[str, str]:
    """(module, its package) for a file path relative to the root."""
    parts = rel.with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def import_targets(node, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        module = f"{base}.{node.module}" if node.module else base
    else:
        module = node.module or ""
    # `from pkg import sub` names a submodule when no module is given
    return [f"{module}.{a.name}" for a in node.names] if node.module is None else [module]


def sizes(files) -> dict:
    lines = sorted(((len(text.splitlines()), str(rel)) for rel, text, _ in files), reverse=True)
    classes = []
    for rel, _, tree in files:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                classes.append((n, f"{rel}:{node.name}"))
    classes.sort(reverse=True)
    return {"largest_files": lines[:TOP], "files_over": [f for f in lines if f[0] > MAX_FILE_LINES],
            "most_methods": classes[:TOP], "classes_over": [c for c in classes if c[0] > MAX_CLASS_METHODS],
            "manager": manager(files)}


def manager(files) -> dict | None:
    for rel, _, tree in files:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "ExpertManager":
                methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                attributes = {t.attr for m in methods for t in ast.walk(m) if isinstance(t, ast.Attribute)
                              and isinstance(t.ctx, ast.Store) and getattr(t.value, "id", "") == "self"}
                attributes |= {b.target.id for b in node.body if isinstance(b, ast.AnnAssign)
                               and isinstance(b.target, ast.Name)}
                init = next((m for m in methods if m.name == "__init__"), None)
                a = init.args if init else None
                return {"file": str(rel), "methods": len(methods), "attributes": len(attributes),
                        "init_lines": init.end_lineno - init.lineno + 1 if init else 0,
                        "init_args": len(a.posonlyargs + a.args + a.kwonlyargs) - 1 if a else 0}
    return None


def imports(files) -> dict:
    back_up, unlayered, inner, deferred, cycles = [], set(), [], 0, 0
    optional = optional_modules(files)
    for rel, text, tree in files:
        module, package = module_name(rel)
        source = layer_of(module)
        if source is None and module != "oled":
            unlayered.add(module)
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inside = {id(i) for f in functions for i in ast.walk(f) if isinstance(i, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = import_targets(node, package)
            if id(node) in inside:
                inner.append(f"{rel}:{node.lineno}")
                if any(t.split(".")[0] in OPTIONAL or t in optional or TRITON_MODULE.match(t) for t in targets):
                    deferred += 1
                else:
                    cycles += bool(CYCLE_COMMENT.search(text.splitlines()[node.end_lineno - 1]))
            for t in targets:
                target = layer_of(t)
                if source is not None and target is not None and target > source:
                    back_up.append(f"{rel}:{node.lineno} {module} ({LAYERS[source][0]}) -> {t} ({LAYERS[target][0]})")
    return {"layers": [name for name, _ in LAYERS], "back_up": back_up, "unlayered": sorted(unlayered),
            "inside_functions": len(inner), "deferred_optional": deferred, "breaking_cycle": cycles,
            "inside_sites": inner}


def optional_modules(files) -> set[str]:
    """The oled modules whose module-level imports reach an OPTIONAL dependency (directly or through oled)."""
    top = {}
    for rel, _, tree in files:
        module, package = module_name(rel)
        inside = {id(i) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for i in ast.walk(f)}
        top[module] = {t for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside
                       for t in import_targets(n, package)}
    optional = {m for m, targets in top.items() if any(t.split(".")[0] in OPTIONAL for t in targets)}
    while grown := {m for m, targets in top.items() if m not in optional and targets & optional}:
        optional |= grown
    return optional


def settings(root: Path, files) -> dict:
    config = root / "oled" / "config.py"
    tree = ast.parse(config.read_text(encoding="utf-8")) if config.exists() else ast.Module(body=[], type_ignores=[])
    config_classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")]
    groups = {c.name for c in config_classes}
    names = {s.target.id for c in config_classes for s in c.body if isinstance(s, ast.AnnAssign)
             and isinstance(s.target, ast.Name) and getattr(s.annotation, "id", None) not in groups}
    flags = {f"--{p}{n.replace('_', '-')}" for n in names for p in ("", "no-")}
    flags |= {k.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
              if k.arg == "flag" and isinstance(k.value, ast.Constant)}            # a setting's own spelling
    hits = {"field": 0, "flag": 0, "keyword": 0}
    capture = {}
    for rel, text, tree in files:
        if text.count("capture_slots"):
            capture[str(rel)] = text.count("capture_slots")
        if rel == Path("oled/config.py"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                hits["field"] += sum(isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) in names
                                     for s in node.body)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                hits["flag"] += sum(isinstance(a, ast.Constant) and a.value in flags for a in node.args)
            value = getattr(node, "value", None)
            if isinstance(node, ast.keyword) and node.arg in names and isinstance(value, ast.Attribute) \
                    and value.attr == node.arg and _last_name(value.value) in SETTING_HOLDERS:
                hits["keyword"] += 1
    return {"setting_names": len(names), "copied": hits, "copied_total": sum(hits.values()),
            "capture_slots": dict(sorted(capture.items(), key=lambda kv: -kv[1])),
            "capture_slots_total": sum(capture.values()), "cli": cli_destinations(root)}


def _last_name(node) -> str | None:
    """`args` for `args`, `cfg` for `self.cfg`."""
    return getattr(node, "id", None) or getattr(node, "attr", None)


CLI_PROBE = """import argparse, json
from oled.cli import build_parser
sub = next(a for a in build_parser()[0]._actions if isinstance(a, argparse._SubParsersAction))
print(json.dumps({n: sorted({a.dest for a in p._actions if a.dest != "help"}) for n, p in sub.choices.items()}))"""


def cli_destinations(root: Path) -> dict | None:
    """Destinations of the CLI's parser over all subcommands; None where ROOT has no CLI to build."""
    if not (root / "oled" / "cli" / "__init__.py").exists():
        return None
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", CLI_PROBE], cwd=root, env=env, capture_output=True, text=True)
    if run.returncode:
        return {"error": (run.stderr.strip().splitlines() or ["failed"])[-1]}
    per = json.loads(run.stdout)
    return {"distinct": len(set().union(*map(set, per.values()))), "per_command": {n: len(d) for n, d in per.items()}}


def prose(files) -> dict:
    figures, sections, prose_chars, total, longest = [], [], 0, 0, (0, "")
    for rel, text, tree in files:
        total += len(text)
        pieces = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc is not None:
                    pieces.append(doc)
                    if isinstance(node, ast.Module):
                        longest = max(longest, (len(doc.splitlines()), str(rel)))
        prose_chars += sum(map(len, pieces))
        for piece in pieces:
            figures += [f"{rel}: {m}" for m in FIGURE.findall(piece)]
            sections += [f"{rel}: {m}" for m in SECTION_REF.findall(piece)]
    return {"figures": figures, "section_refs": sections, "prose_share": round(prose_chars / max(total, 1), 3),
            "longest_module_docstring": longest}


def record(root: Path) -> dict:
    out = {}
    for name in ("README.md", "BENCHMARKS.md"):
        p = root / name
        text = p.read_text(encoding="utf-8") if p.exists() else ""
        out[name] = {"lines": len(text.splitlines()), "bytes": len(text.encode())}
    lines = (root / "README.md").read_text(encoding="utf-8").splitlines() if (root / "README.md").exists() else []
    longest = max(((len(l), i + 1) for i, l in enumerate(lines)), default=(0, 0))
    out["README.md"].update(longest_line={"chars": longest[0], "line": longest[1]},
                            python_c=sum(len(ONE_LINER.findall(l)) for l in lines),
                            section_refs=sum(len(NUMBERED_SECTION.findall(l)) for l in lines))
    return out


def tracked(root: Path) -> list[str]:
    """Files git tracks under ROOT (every file where ROOT is not a git checkout)."""
    run = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True)
    if run.returncode == 0 and (root / ".git").exists():
        return run.stdout.splitlines()
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]


def benchmarks(root: Path) -> dict:
    files = tracked(root)
    bench = [f for f in files if f.startswith("benchmarks/")]
    top = sorted(f for f in bench if f.count("/") == 1 and f.endswith(SCRIPT_SUFFIXES))
    probes = sorted(f for f in bench if f.startswith("benchmarks/probes/") and f.endswith(SCRIPT_SUFFIXES))
    tests = "\n".join((root / f).read_text(encoding="utf-8") for f in files
                      if f.startswith("tests/") and f.endswith(".py") and (root / f).exists())
    driver = root / "benchmarks" / "h200.sh"
    driver = driver.read_text(encoding="utf-8") if driver.exists() else ""
    used = {}
    for f in top:
        word = re.compile(rf"\b{re.escape(Path(f).stem)}\b")
        used[f] = {"test": bool(word.search(tests)), "h200.sh": f != "benchmarks/h200.sh" and bool(word.search(driver))}
    return {"tracked": len(files), "benchmarks": len(bench),
            "results": sum(f.startswith("benchmarks/results/") for f in bench),
            "top_scripts": used, "probes": probes,
            "unreferenced": [f for f, u in used.items() if not any(u.values()) and f != "benchmarks/h200.sh"]}


def report(root: Path) -> dict:
    files = python_files(root)
    return {"root": str(root), "sizes": sizes(files), "imports": imports(files), "settings": settings(root, files),
            "prose": prose(files), "record": record(root), "benchmarks": benchmarks(root)}


def flag(over: bool) -> str:
    return "  <-- over" if over else ""


def print_report(r: dict) -> None:
    s, i, c, p, b = r["sizes"], r["imports"], r["settings"], r["prose"], r["benchmarks"]
    print(f"house report for {r['root']}\n\nlargest files under oled/ (lines; limit {MAX_FILE_LINES}):")
    for n, f in s["largest_files"]:
        print(f"  {n:5d} {f}{flag(n > MAX_FILE_LINES)}")
    print(f"  files over the limit: {len(s['files_over'])}\nclasses with most methods (limit {MAX_CLASS_METHODS}):")
    for n, k in s["most_methods"]:
        print(f"  {n:5d} {k}{flag(n > MAX_CLASS_METHODS)}")
    print(f"  classes over the limit: {len(s['classes_over'])}")
    m = s["manager"]
    print("ExpertManager: " + (f"{m['methods']} methods, {m['attributes']} attributes, __init__ {m['init_lines']} "
                               f"lines with {m['init_args']} arguments ({m['file']})" if m else "absent"))
    print(f"\nlayers, lowest first: {' < '.join(i['layers'])}\nimports back up a layer: {len(i['back_up'])}")
    for line in i["back_up"]:
        print("  " + line)
    if i["unlayered"]:
        print(f"modules in no layer: {', '.join(i['unlayered'])}")
    print(f"imports inside functions: {i['inside_functions']} ({i['deferred_optional']} defer Triton or an optional "
          f"dependency, {i['breaking_cycle']} break a cycle)")
    cli = c["cli"] or {}
    print(f"\nsettings (fields of oled/config.py's configs): {c['setting_names']}\ncopied by hand outside config.py: "
          f"{c['copied_total']} ({', '.join(f'{k} {v}' for k, v in c['copied'].items())})\ncapture_slots: "
          f"{c['capture_slots_total']} in {len(c['capture_slots'])} files: "
          f"{', '.join(f'{f} {n}' for f, n in c['capture_slots'].items())}")
    print("CLI destinations: " + (f"{cli['distinct']} distinct over all subcommands; per command "
                                  f"{cli['per_command']}" if "distinct" in cli else str(cli.get("error", "no CLI"))))
    print(f"\nmeasured figures in oled/'s comments and docstrings: {len(p['figures'])}")
    for f in p["figures"]:
        print("  " + f)
    print(f"section / BENCHMARKS references in oled/'s comments and docstrings: {len(p['section_refs'])}")
    for f in p["section_refs"]:
        print("  " + f)
    n, f = p["longest_module_docstring"]
    print(f"prose share of oled/'s characters: {p['prose_share']:.1%}\nlongest module docstring: {n} lines ({f})")
    for name, v in r["record"].items():
        print(f"\n{name}: {v['lines']} lines, {v['bytes']:,} bytes", end="")
    rd = r["record"]["README.md"]
    print(f"\nREADME.md longest line: {rd['longest_line']['chars']} chars (line {rd['longest_line']['line']}); "
          f"python -c one-liners: {rd['python_c']}; section references: {rd['section_refs']}")
    print(f"\nbenchmarks/: {b['benchmarks']} of {b['tracked']} tracked files, {b['results']} under results/; "
          f"{len(b['top_scripts'])} top-level scripts, {len(b['probes'])} probes")
    for f, u in b["top_scripts"].items():
        print(f"  {f}: " + (", ".join(k for k, v in u.items() if v) or "referenced by neither a test nor h200.sh"))
    for f in b["probes"]:
        print(f"  probe {f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent),
                    help="the tree to measure (default: this repository)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    if not (root / "oled").is_dir():
        print(f"house_report: {root} has no oled/ package", file=sys.stderr)
        return 2
    r = report(root)
    print(json.dumps(r, indent=1, ensure_ascii=False)) if args.json else print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
