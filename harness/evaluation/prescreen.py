"""A static pre-screen of submitted sources: constructs a reviewer should look at.

It reads the source of the modules a manifest's entry points live in (and, for a checkout, every
Python file under it) and reports stream creation, patching of torch / time / the harness,
threads and processes, network access, environment reads and frame or memory introspection.
Findings are warnings for the reviewer, never a verdict: the engine's checks are the defence.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PATCHED_MODULES = {"torch", "time", "triton", "harness", "numpy", "np", "os", "sys"}
CALLS = {
    "torch.cuda.Stream": "creates a CUDA stream",
    "torch.cuda.stream": "switches CUDA streams",
    "torch.cuda.set_stream": "switches CUDA streams",
    "threading.Thread": "starts a thread",
    "subprocess.Popen": "starts a process",
    "subprocess.run": "starts a process",
    "subprocess.call": "starts a process",
    "subprocess.check_output": "starts a process",
    "os.system": "starts a process",
    "os.popen": "starts a process",
    "os.fork": "forks the process",
    "os.getenv": "reads the environment",
    "os.kill": "signals a process",
    "socket.socket": "opens a network socket",
    "socket.create_connection": "opens a network connection",
    "sys._getframe": "inspects interpreter frames",
    "inspect.currentframe": "inspects interpreter frames",
    "gc.get_objects": "walks the interpreter's objects",
    "gc.get_referrers": "walks the interpreter's objects",
    "ctypes.CDLL": "loads a native library",
    "setattr": "sets attributes dynamically",
}
IMPORTS = {
    "socket": "network access",
    "urllib": "network access",
    "http": "network access",
    "requests": "network access",
    "httpx": "network access",
    "aiohttp": "network access",
    "subprocess": "processes",
    "multiprocessing": "processes",
    "threading": "threads",
    "concurrent": "threads or processes",
    "ctypes": "native code",
    "cffi": "native code",
}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}: {self.code}"


def screen_files(paths: list[Path], root: Path) -> list[Finding]:
    findings: list[Finding] = []
    for path in sorted(set(paths)):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
            findings.append(Finding(_label(path, root), 0, "could not be read or parsed", str(exc)))
            continue
        lines = source.splitlines()
        findings += [
            Finding(_label(path, root), line, what, lines[line - 1].strip()[:120] if line else "")
            for line, what in _visit(tree)
        ]
    return findings


def _visit(tree: ast.AST) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in CALLS:
                hits.append((node.lineno, CALLS[name]))
        elif isinstance(node, ast.Attribute) and _dotted(node) == "os.environ":
            hits.append((node.lineno, "reads the environment"))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            hits += [(node.lineno, f"patches {name}") for name in _patched(node)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            hits += [(node.lineno, f"imports {m} ({IMPORTS[m]})") for m in _imported(node)]
    return sorted(set(hits))


def _patched(node: ast.Assign | ast.AugAssign) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = [_dotted(t) for t in targets if isinstance(t, ast.Attribute)]
    return [n for n in names if n and n.split(".")[0] in PATCHED_MODULES]


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return sorted({m.split(".")[0] for m in modules if m.split(".")[0] in IMPORTS})


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _label(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)
