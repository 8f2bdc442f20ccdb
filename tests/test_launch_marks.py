"""Every test that starts a process (torchrun through tests/distributed.run_distributed, a Python
subprocess, a shell script) carries the `launches` mark, so that `make test-fast` (-m "not launches")
runs in-process units only. Read from the source (tests/marks.py): a launch through a helper, a
fixture or a conftest fixture counts. tests/bridge (its own lane, not in test-fast) is left out."""

from __future__ import annotations

import textwrap

from tests.marks import TESTS, Launches


def test_every_test_that_starts_a_process_is_marked_launches():
    paths = [p for p in sorted(TESTS.rglob("*.py")) if TESTS / "bridge" not in p.parents]
    unmarked = Launches(paths).unmarked()
    assert not unmarked, "start processes without @pytest.mark.launches:\n" + "\n".join(unmarked)


def test_launches_through_helpers_and_fixtures_are_seen(tmp_path, monkeypatch):
    # A stand-in suite: a helper module, a conftest fixture and tests using them, marked or not.
    import tests.marks as marks

    root = tmp_path / "tests"
    (root / "sub").mkdir(parents=True)
    files = {
        "helper.py": "import subprocess as sp\n\ndef start():\n    return sp.run(['true'])\n",
        "conftest.py": "import pytest\nfrom tests.helper import start\n\n@pytest.fixture\ndef ran():\n    start()\n",
        "sub/test_a.py": textwrap.dedent("""\
            import os
            import pytest
            from tests.distributed import run_distributed
            from tests.helper import start

            @pytest.fixture(name="torchrun")
            def _torchrun():
                run_distributed(["x.py"])

            def _indirect():
                start()

            def test_by_helper():
                _indirect()

            def test_by_conftest_fixture(ran):
                pass

            def test_by_own_fixture(torchrun):
                pass

            def test_by_os():
                os.system("true")

            @pytest.mark.launches
            def test_marked():
                start()

            def test_in_process(tmp_path):
                assert os.path.join("a", "b")
            """),
        "sub/test_b.py": "import subprocess\nimport pytest\n\npytestmark = pytest.mark.launches\n\n"
                         "def test_module_marked():\n    subprocess.run(['true'])\n",
        "distributed.py": "import subprocess\n\ndef run_distributed(target):\n    subprocess.run(target)\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    monkeypatch.setattr(marks, "ROOT", tmp_path)
    monkeypatch.setattr(marks, "TESTS", root)
    found = Launches(sorted(root.rglob("*.py"))).unmarked()
    assert found == [f"tests/sub/test_a.py::{t}" for t in
                     ("test_by_conftest_fixture", "test_by_helper", "test_by_os", "test_by_own_fixture")]
