"""tools/house_report.py: each measure on a tiny synthetic tree, and the invariants of issue 52 on this repository."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "house_report.py"


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), str(root), *args], capture_output=True, text=True)


def report(root: Path) -> dict:
    done = run(root, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def write(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_sizes_and_the_manager(tmp_path):
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(26))
    init = "    def __init__(self, a, b, *, c=1):\n        self.x = a\n        self.y, self.z = b, c\n"
    write(tmp_path, {"oled/__init__.py": "", "oled/big.py": "x = 1\n" * 501,
                     "oled/runtime/manager.py": f"class ExpertManager:\n    n: int\n{init}{methods}"})
    s = report(tmp_path)["sizes"]
    assert s["files_over"] == [[501, "oled/big.py"]]
    assert s["classes_over"] == [[27, "oled/runtime/manager.py:ExpertManager"]]
    assert s["manager"] == {"file": "oled/runtime/manager.py", "methods": 27, "attributes": 4, "init_lines": 3,
                            "init_args": 3}


@pytest.mark.parametrize("source, line", [
    ("oled/policies/base.py", "from ..runtime import planner"),                # policies -> runtime
    ("oled/runtime/host_memory.py", "from ..loader import EXPERT_NAME"),       # runtime -> loader
    ("oled/kernels/triton_confidence.py", "from oled.decoding.rules import x"),  # kernels -> decoding
    ("oled/trace/__init__.py", "from ..bench import env"),                     # trace -> bench
])
def test_the_four_back_up_imports_of_the_issue_are_caught(tmp_path, source, line):
    write(tmp_path, {"oled/__init__.py": "", source: line + "\n"})
    back_up = report(tmp_path)["imports"]["back_up"]
    assert len(back_up) == 1 and back_up[0].startswith(f"{source}:1 ")


def test_imports_down_the_layers_and_inside_functions(tmp_path):
    write(tmp_path, {"oled/__init__.py": "from .llm import LLM\n",
                     "oled/env.py": "def version():\n    from . import __version__\n    return __version__\n",
                     "oled/runtime/cache.py": "from ..policies import contract\nfrom . import store\n"
                                              "def f():\n    import triton\n    from ..kernels.triton_moe import k\n"
                                              "    from .store import s\n",
                     "oled/cli/x.py": "from oled.runtime import cache\nfrom oled.engine import Engine\n"})
    i = report(tmp_path)["imports"]
    assert i["back_up"] == [] and i["unlayered"] == []
    assert (i["inside_functions"], i["deferred_optional"], i["breaking_cycle"]) == (4, 2, 0)


def test_deferred_imports_of_optional_modules_and_declared_cycles(tmp_path):
    """An oled module counts as optional when its top imports reach an extra; a required dependency (tqdm) does not
    excuse a deferral; a cycle counts only when the line says so."""
    write(tmp_path, {"oled/__init__.py": "",
                     "oled/server/protocol.py": "import pydantic\n",
                     "oled/server/routes.py": "from .protocol import Request\n",
                     "oled/engine.py": "import torch\n",
                     "oled/cli/serve.py": "def run():\n    from ..server.routes import create_app\n"
                                          "    import readline\n    from tqdm import tqdm\n"
                                          "    from ..engine import Engine  # cycle: engine imports the CLI\n"
                                          "    from ..engine import load\n"})
    i = report(tmp_path)["imports"]
    assert (i["inside_functions"], i["deferred_optional"], i["breaking_cycle"]) == (5, 2, 1)


def test_settings_copied_capture_slots_and_no_cli(tmp_path):
    config = ("class CpuConfig:\n    threads: int = 0\n    pin_memory: bool = setting(True, 'h', flag='--no-pin')\n"
              "class EngineConfig:\n    policy: str = 'oled'\n    cpu: CpuConfig = None\n    capture_slots: int = 0\n")
    other = ("class BenchConfig:\n    policy: str = 'lru'\n    runs: int = 1\n"
             "def f(p, args):\n    p.add_argument('--threads')\n    p.add_argument('--no-pin')\n"
             "    g(policy=args.policy, threads=self.threads, capture_slots=args.capture_slots)\n")
    write(tmp_path, {"oled/__init__.py": "", "oled/config.py": config, "oled/bench/runner.py": other})
    s = report(tmp_path)["settings"]
    assert s["setting_names"] == 4                         # threads, pin_memory, policy, capture_slots; not cpu
    assert s["copied"] == {"field": 1, "flag": 2, "keyword": 2}
    assert s["capture_slots"] == {"oled/bench/runner.py": 2, "oled/config.py": 1}
    assert s["cli"] is None


def test_figures_section_references_and_prose(tmp_path):
    code = ('"""A module.\n\nTwo lines; see section 12."""\n'
            "x = 1  # 3.5 ms on the H200, 4.3 TB/s\n"
            "y = '10 ms in a string is code, not prose'\n"
            "def f():\n    '''2x faster than BENCHMARKS.md says'''\n")
    write(tmp_path, {"oled/__init__.py": "", "oled/a.py": code})
    p = report(tmp_path)["prose"]
    assert p["figures"] == ["oled/a.py: 3.5 ms", "oled/a.py: 4.3 TB/s", "oled/a.py: 2x faster"]
    assert p["section_refs"] == ["oled/a.py: section 12", "oled/a.py: BENCHMARKS"]
    assert p["longest_module_docstring"] == [3, "oled/a.py"]
    assert 0.4 < p["prose_share"] < 0.7


def test_record_and_benchmarks(tmp_path):
    readme = "# x\n" + "a" * 90 + "\nrun `python3 -c \"import gzip\"` (section 3, section 4; see BENCHMARKS.md)\n"
    write(tmp_path, {"oled/__init__.py": "", "README.md": readme, "BENCHMARKS.md": "one\ntwo\n",
                     "benchmarks/h200.sh": "python3 benchmarks/used.py\n", "benchmarks/used.py": "",
                     "benchmarks/tested.py": "", "benchmarks/orphan.py": "", "benchmarks/probes/p.py": "",
                     "benchmarks/results/a/r.json": "{}", "tests/test_t.py": "import benchmarks.tested\n"})
    r = report(tmp_path)
    rd = r["record"]["README.md"]
    assert (rd["lines"], rd["longest_line"], rd["python_c"], rd["section_refs"]) == \
        (3, {"chars": 90, "line": 2}, 1, 2)
    assert r["record"]["BENCHMARKS.md"] == {"lines": 2, "bytes": 8}
    b = r["benchmarks"]
    assert (b["benchmarks"], b["results"], b["probes"]) == (6, 1, ["benchmarks/probes/p.py"])
    assert b["top_scripts"]["benchmarks/used.py"] == {"test": False, "h200.sh": True}
    assert b["top_scripts"]["benchmarks/tested.py"] == {"test": True, "h200.sh": False}
    assert b["unreferenced"] == ["benchmarks/orphan.py"]


def test_a_root_without_the_package_is_a_usage_error(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no oled/" in done.stderr


def test_the_repository_keeps_the_issue_52_invariants():
    r = report(REPO)
    assert r["sizes"]["files_over"] == [] and r["sizes"]["classes_over"] == []
    assert r["imports"]["back_up"] == [] and r["imports"]["unlayered"] == []
    assert r["prose"]["section_refs"] == [] and r["prose"]["figures"] == []
    assert r["record"]["README.md"]["python_c"] == 0 and r["record"]["README.md"]["section_refs"] == 0
    assert r["settings"]["cli"]["distinct"] > 0
