"""megatron_zero/testing/source_changes.py: the files changed since a snapshot, which tests/conftest.py names in a
failing test's report (a tree edited or merged into while the session ran gives the ranks another version)."""
import os

from megatron_zero.testing.source_changes import changed_since, snapshot


def test_edited_added_and_removed_files_are_named(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    for name in ("a.py", "b.py", "gone.py", "notes.md"):
        (pkg / name).write_text("x = 1\n")
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"")
    script = tmp_path / "run.py"
    script.write_text("")
    before = snapshot(str(pkg), str(script))
    assert changed_since(before, str(pkg), str(script)) == []
    (pkg / "a.py").write_text("x = 2\n")
    os.utime(pkg / "a.py", ns=(1, 1))  # another mtime whatever the file system's resolution
    (pkg / "new.py").write_text("")
    (pkg / "gone.py").unlink()
    (pkg / "notes.md").write_text("not source\n")
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"changed")
    os.utime(script, ns=(1, 1))
    assert changed_since(before, str(pkg), str(script)) == sorted(
        [str(pkg / "a.py"), str(pkg / "gone.py"), str(pkg / "new.py"), str(script)])
