"""Every command a reader copies from README.md and docs/training.md runs as written.

Each document's runnable blocks (``tools/doc_blocks.py``) run in order, in one fresh copy of the
repository beside a link to ``../shared`` (the corpus), so a block may use what an earlier block
of the same document made, and nothing else: no hidden step. Blocks marked
``<!-- ci: skip: REASON -->`` (GPU runs; the install and test commands `.ci/run` runs itself)
are left out, and the skip list is pinned here so a new skip is a visible change.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from doc_blocks import blocks  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared")
SKIPPED = {  # (document, section) of every block not run here
    "README.md": [("Set up", ".ci/run runs this install command itself"),
                  ("Set up", "this is the test command .ci/run runs")],
    "docs/training.md": [("Quick start", "needs 8 GPUs"),
                         ("Data and tokenizers", "tokenizes the whole corpus (a minute on 2 cores); "
                          "the Quick start runs the same tool on a slice"),
                         ("Data and tokenizers", "needs the SlimPajama download (627B tokens)")],
}


def _copy_repo(dest: str) -> str:
    repo = os.path.join(dest, "repo")
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".git", "runs", "data", "__pycache__", "*.egg-info", ".pytest_cache", ".whl", "bench"))
    if os.path.isdir(SHARED):
        os.symlink(os.path.abspath(SHARED), os.path.join(dest, "shared"))
    return repo


def _run_document(doc: str, tmp_path) -> str:
    repo = _copy_repo(str(tmp_path))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = []
    for n, block in enumerate(b for b in blocks(os.path.join(ROOT, doc)) if b.runnable):
        if block.skip:
            continue
        if block.lang == "python":
            script = os.path.join(repo, f"_doc_block_{n}.py")
            with open(script, "w") as f:
                f.write(block.code)
            cmd = [sys.executable, script]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", block.code]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=900)
        log.append(f"--- {doc}:{block.line} ({block.section})\n{proc.stdout[-3000:]}")
        assert proc.returncode == 0, (
            f"{doc}:{block.line} ({block.section}) failed with {proc.returncode}:\n"
            f"{block.code}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return "\n".join(log)


@pytest.mark.parametrize("doc", sorted(SKIPPED))
def test_skipped_blocks_are_the_pinned_ones(doc):
    found = [(b.section, b.skip) for b in blocks(os.path.join(ROOT, doc)) if b.skip]
    assert found == SKIPPED[doc]


def test_ci_runs_the_readme_commands():
    """`.ci/run` reads the README's set-up blocks, so a step the README lacks is missing in CI."""
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert 'doc_blocks.py README.md --section "Set up" --index 0' in ci
    assert 'doc_blocks.py README.md --section "Set up" --index 1' in ci
    setup = [b for b in blocks(os.path.join(ROOT, "README.md"))
             if b.section == "Set up" and b.runnable]
    assert "mistral-common" in setup[0].code and "pytest" in setup[1].code
    assert "pip install" not in ci and "-m pytest" not in ci  # nothing of its own


def test_skip_marker_needs_a_reason(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("# T\n<!-- ci: skip: -->\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        blocks(str(bad))


@pytest.mark.skipif(not os.path.isdir(SHARED), reason="the corpus in ../shared is absent")
@pytest.mark.parametrize("doc", ["README.md", "docs/training.md"])
def test_document_blocks_run_as_written(doc, tmp_path):
    out = _run_document(doc, tmp_path)
    if doc == "README.md":
        assert "torch.Size([2, 512, 32000])" in out  # the library snippet's logits
    else:
        assert "perplexity" in out.lower()
