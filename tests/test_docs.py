"""The documentation: README.md, docs/ and the other tracked Markdown files.

- Links: every relative Markdown link outside code names a file or folder that
  exists, and a `#anchor` names a heading of the target file (GitHub's anchor
  rule: lower case, punctuation dropped, spaces to hyphens, "-1", "-2" for
  repeats). Web links are not followed.
- Commands: every line of a ```bash block is handed to the parser of the
  program it runs, with its exact tokens, and fails on a flag that parser does
  not accept: `launch/xla_spawn.py` (its parser, then the script it launches),
  `launch/run_clm.py` (run_clm's own parse_args, config files included),
  `python -m xla_fsdp.aot` (its parser, the accelerator type, the job's
  command as the check reads it, then that command's own parsers), the
  `bench/` scripts (their build_parser), `tpu_scripts/*.sh` (run with
  `--dry-run`), `make TARGET` (the target exists in the Makefile) and
  `export NAME=value`. A command nothing here can check fails too.
- ```python blocks parse.
- The README holds at most 400 lines, and its quick start is the two commands.
- Each docs/*.md holds at most 400 lines: today's figures and how to reproduce them;
  history stays in bench/results/ and in git.
"""
import ast
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bench_modules

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 400
DOCS_MAX_LINES = 400
COMMAND_LANGS = {"bash", "sh", "shell"}
FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def markdown_files() -> list:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = sorted(ROOT / name for name in out.stdout.split())
    assert ROOT / "README.md" in files
    return files


def split_markdown(path: Path):
    """(text outside code blocks, [(language, first line number, code)])."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = FENCE.match(line)
        if block is None and fence:
            block = (fence.group(1).lower(), number + 1, [])
        elif block is not None and fence and not fence.group(1):
            blocks.append((block[0], block[1], textwrap.dedent("\n".join(block[2]))))
            block = None
        elif block is not None:
            block[2].append(line)
        else:
            prose.append(line)
    assert block is None, f"{path}: a code block opened at line {block[1] - 1} is never closed"
    return "\n".join(prose), blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    prose, _ = split_markdown(path)
    seen, out = {}, set()
    for line in prose.splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list:
    prose, _ = split_markdown(path)
    prose = INLINE_CODE.sub("", prose)  # a link inside `code` is not a link
    return [target for _, target in LINK.findall(prose)]


def broken_link(path: Path, target: str):
    """Why `target` (a link in `path`) does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    resolved = (path.parent / file_part).resolve() if file_part else path
    if not resolved.exists():
        return f"{target}: {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved} does not exist"
    if anchor:
        if resolved.suffix != ".md":
            return f"{target}: an anchor into a file that is not Markdown"
        if anchor not in anchors(resolved):
            return f"{target}: no heading of {resolved.relative_to(ROOT)} has the anchor #{anchor}"
    return None


LINK_CASES = [(path, target) for path in markdown_files() for target in links(path)]


def test_the_docs_have_links():
    # the link check below must have something to check
    readme = [t for p, t in LINK_CASES if p.name == "README.md" and p.parent == ROOT]
    assert any(t.startswith("docs/") for t in readme), "README.md links no file of docs/"


@pytest.mark.parametrize("path,target", LINK_CASES,
                         ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in LINK_CASES])
def test_relative_link_resolves(path, target):
    problem = broken_link(path, target)
    assert problem is None, f"{path.relative_to(ROOT)}: broken link {problem}"


# --------------------------------------------------------------------------
# Commands in ```bash blocks


def commands(path: Path) -> list:
    """(line number, the command's logical line) for every command in `path`'s bash blocks."""
    out = []
    for lang, first, code in split_markdown(path)[1]:
        if lang not in COMMAND_LANGS:
            continue
        pending, start = "", None
        for offset, line in enumerate(code.splitlines()):
            if start is None:
                start = first + offset
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            logical = (pending + line).strip()
            pending = ""
            if shlex.split(logical, comments=True):
                out.append((start, logical))
            start = None
    return out


def load_launcher():
    spec = importlib.util.spec_from_file_location("xla_spawn_for_docs", ROOT / "launch" / "xla_spawn.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def parse_with(parse, argv: list, what: str) -> None:
    """Run `parse(argv)`; an argparse error (SystemExit) fails with the parser's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse(argv)
    except SystemExit as exc:
        said = err.getvalue().strip().splitlines() or [""]
        pytest.fail(f"{what} refuses {shlex.join(argv)!r} (exit {exc.code}): {said[-1]}")


def check_script(argv: list) -> None:
    """`SCRIPT ARGS...` as `python SCRIPT ARGS...` runs it."""
    script, args = argv[0], argv[1:]
    assert (ROOT / script).is_file(), f"no such script: {script}"
    if script == "launch/xla_spawn.py":
        launcher = load_launcher()
        ours, target, rest = launcher.split_argv(args)
        parse_with(launcher.build_parser().parse_args, ours, "launch/xla_spawn.py")
        assert target is not None, "xla_spawn is given no script"
        check_script([target] + rest)
    elif script == "launch/run_clm.py":
        from xla_fsdp.train import args as run_clm_args

        parse_with(run_clm_args.parse_args, args, "launch/run_clm.py")
    elif script.startswith("bench/") and script.endswith(".py"):
        module = bench_modules.load(Path(script).stem)
        assert hasattr(module, "build_parser"), f"{script} has no build_parser() to check its flags with"
        parse_with(module.build_parser().parse_args, args, script)
    elif script.startswith("examples/") and script.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", ROOT / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
        spec.loader.exec_module(module)  # examples define parse_args(argv) and run only under __main__
        parse_with(module.parse_args, args, script)
    else:
        pytest.fail(f"no parser known for {script}; teach tests/test_docs.py to check it")


def check_aot(args: list) -> None:
    from xla_fsdp.aot import cli, trace
    from xla_fsdp.tpu import topology

    ours, job = cli.split_command(args)
    parse_with(cli.build_parser().parse_args, ours, "python -m xla_fsdp.aot")
    opts = cli.build_parser().parse_args(ours)
    spec = topology.parse_accelerator_type(opts.tpu)
    trace.job_from_command(job, opts.runtime, spec.chips)  # what the check reads of the job's command
    check_script(job)


def makefile_targets() -> set:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.MULTILINE))


def check_tpu_script(name: str, args: list, tmp_path: Path) -> None:
    # a gcloud that fails, first on PATH: --dry-run must not reach a real cloud account
    guard = tmp_path / "bin"
    guard.mkdir()
    (guard / "gcloud").write_text("#!/bin/sh\necho 'the docs test ran gcloud for real' >&2\nexit 99\n")
    (guard / "gcloud").chmod(0o755)
    env = {**os.environ, "PATH": f"{guard}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(ROOT / name), "--dry-run", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{name} --dry-run {shlex.join(args)}: {result.stderr.strip()}"


def check_command(line: str, tmp_path: Path) -> None:
    words = shlex.split(line, comments=True)
    while words and ENV_ASSIGNMENT.match(words[0]):  # NAME=value before the command
        words.pop(0)
    assert words, f"nothing but assignments: {line!r}"
    program, args = words[0], words[1:]
    if program == "export":
        assert args and all(ENV_ASSIGNMENT.match(a) for a in args), f"export takes NAME=value: {line!r}"
    elif program == "make":
        missing = [t for t in args if not t.startswith("-") and "=" not in t and t not in makefile_targets()]
        assert args and not missing, f"no such Makefile target: {missing or line!r}"
    elif program in ("python", "python3"):
        while args and args[0] == "-u":
            args = args[1:]
        if args[:2] == ["-m", "xla_fsdp.aot"]:
            check_aot(args[2:])
        elif args and args[0] == "-m":
            pytest.fail(f"no parser known for python -m {args[1:2]}; teach tests/test_docs.py to check it")
        else:
            check_script(args)
    elif program.startswith("tpu_scripts/") and program.endswith(".sh"):
        check_tpu_script(program, args, tmp_path)
    else:
        pytest.fail(f"no parser known for {program!r}; teach tests/test_docs.py to check it")


COMMAND_CASES = [(path, number, line) for path in markdown_files() for number, line in commands(path)]


def test_the_docs_have_commands():
    shown = {line for path, _, line in COMMAND_CASES if path == ROOT / "README.md"}
    assert {"make train", "make test"} <= {shlex.join(shlex.split(c, comments=True)) for c in shown}
    assert any("launch/xla_spawn.py" in c for c in shown) and any("xla_fsdp.aot" in c for c in shown)


@pytest.mark.parametrize("path,number,line", COMMAND_CASES,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in COMMAND_CASES])
def test_command_parses(path, number, line, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands run from the repository root; their paths are relative to it
    check_command(line, tmp_path)


PYTHON_CASES = [(path, first, code) for path in markdown_files()
                for lang, first, code in split_markdown(path)[1] if lang == "python"]


@pytest.mark.parametrize("path,first,code", PYTHON_CASES,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in PYTHON_CASES])
def test_python_block_parses(path, first, code):
    try:
        ast.parse(code)
    except SyntaxError as exc:
        pytest.fail(f"{path.relative_to(ROOT)}:{first + (exc.lineno or 1) - 1}: {exc.msg}")


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
                                            "move a topic to docs/")


DOCS_FILES = sorted((ROOT / "docs").glob("*.md"))


def test_the_docs_folder_has_files():
    assert DOCS_FILES, "docs/ holds no Markdown file"


@pytest.mark.parametrize("path", DOCS_FILES, ids=[p.name for p in DOCS_FILES])
def test_docs_file_is_short(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= DOCS_MAX_LINES, (f"{path.relative_to(ROOT)} has {len(lines)} lines (at most "
                                          f"{DOCS_MAX_LINES}): keep today's figures and how to reproduce "
                                          "them, leave history to bench/results/ and git, or split the topic "
                                          "into a second docs file linked from the first")


def test_quick_start_is_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert block, "README's quick start shows no bash block"
    shown = [shlex.join(shlex.split(line, comments=True)) for line in block.group(1).splitlines()]
    assert shown == ["make train", "make test"]
