"""Start-up on CPU: one line per expected absence instead of Megatron's and torch's warning walls."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from snip_megatron.megatron import startup
from snip_megatron.megatron.startup import ABSENCES, CUDA_LOGGER, quiet_startup

ROOT = Path(__file__).resolve().parents[2]
WALL = ("Transformer Engine and Apex are not installed", "absl.logging is not installed",
        "No CUDA runtime is found", "UserWarning")


def child_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK")}
    # CUDA_HOME set on a machine without a GPU is what makes torch log "No CUDA runtime is found".
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_HOME=str(tmp_path))
    return env


def absent() -> list:
    return [a for a in ABSENCES if not startup._installed(a.module)]


@pytest.mark.launches
def test_demo_help_prints_notices_not_the_wall(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "snip_megatron.demo", "--help"], cwd=tmp_path,
                          env=child_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    for text in WALL:
        assert text not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    expected = [a.notice for a in absent()]
    assert {a.module for a in absent()} >= {"transformer_engine", "apex"}  # true in both CPU lanes
    for notice in expected:
        assert lines.count(f"[snip] {notice}") == 1, proc.stderr
    assert all(line.startswith("[snip] ") for line in lines), proc.stderr


@pytest.mark.launches
def test_without_it_the_wall_is_there(tmp_path):
    # The same import without quiet_startup: what the notices replace (and what the test above checks).
    proc = subprocess.run([sys.executable, "-c", "import snip_megatron.data.prepare"], cwd=tmp_path,
                          env=child_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("Transformer Engine and Apex are not installed") >= 3, proc.stderr


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(startup, "_done", False)
    logger = logging.getLogger(CUDA_LOGGER)
    before = list(logger.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    logger.filters[:] = before


def warn_from(module: str, message: str) -> None:
    warnings.warn_explicit(message, UserWarning, f"{module.replace('.', '/')}.py", 1, module=module)


def test_only_the_replaced_warnings_are_filtered(fresh, monkeypatch):
    monkeypatch.setattr(startup, "_installed", lambda module: module != "apex")  # apex absent only
    out = io.StringIO()
    assert quiet_startup(stream=out) == [next(a.notice for a in ABSENCES if a.module == "apex")]
    assert out.getvalue().splitlines() == [f"[snip] {ABSENCES[1].notice}"]
    warn_from("megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm")
    warn_from("megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back")
    # Kept: another megatron warning, the same text from elsewhere, and TE's family (TE "installed").
    warn_from("megatron.core.model_parallel_config", "Transformer Engine cross entropy loss fusion has known stability issues")
    warn_from("someone.else", "Apex is not installed. Falling back to Torch Norm")
    warn_from("megatron.core.extensions.transformer_engine_spec_provider",
              "Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0.")
    assert [(w.filename.split(".")[0], str(w.message).split(".")[0]) for w in fresh] == [
        ("megatron/core/model_parallel_config", "Transformer Engine cross entropy loss fusion has known stability issues"),
        ("someone/else", "Apex is not installed"),
        ("megatron/core/extensions/transformer_engine_spec_provider", "Only transformer-engine>=1"),
    ]
    assert quiet_startup(stream=out) == [] and len(out.getvalue().splitlines()) == 1  # idempotent


@pytest.mark.compat
def test_megatrons_notices_about_its_own_defaults_are_filtered(fresh, monkeypatch):
    monkeypatch.setattr(startup, "_installed", lambda module: True)
    gpt_logger = logging.getLogger(startup.GPT_LOGGER)
    before = list(gpt_logger.filters)
    try:
        quiet_startup(stream=io.StringIO())
        warn_from("megatron.core.transformer.transformer_config",
                  "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.")
        warn_from("megatron.core.models.mimo.config.base_configs", "MimoModelConfig is experimental and still ...")
        warn_from("megatron.core.transformer.transformer_config", "another deprecation")  # kept
        assert [str(w.message) for w in fresh] == ["another deprecation"]
        record = logging.LogRecord(startup.GPT_LOGGER, logging.WARNING, "gpt_model.py", 1,
                                   "GPTModel IS DEPRECATED. GPTModel is only accepting ...", None, None)
        other = logging.LogRecord(startup.GPT_LOGGER, logging.WARNING, "gpt_model.py", 1, "other", None, None)
        assert not gpt_logger.filter(record) and gpt_logger.filter(other)
    finally:
        gpt_logger.filters[:] = before


@pytest.mark.launches
@pytest.mark.compat
def test_building_the_demo_model_prints_only_snips_lines(tmp_path):
    code = ("from snip_megatron.megatron.startup import quiet_startup; quiet_startup()\n"
            "from snip_megatron.megatron import runtime\n"
            "from snip_megatron.megatron.model import build_gpt_model\n"
            "from snip_megatron.shapes import PRESETS\n"
            "runtime.init_process_group(backend='gloo'); runtime.initialize_model_parallel()\n"
            "build_gpt_model(PRESETS['llama_tiny'], backend='emulated')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert all(line.startswith("[snip] ") for line in proc.stderr.splitlines()), proc.stderr


def test_cuda_home_record_becomes_one_line(fresh, monkeypatch):
    monkeypatch.setattr(startup, "_installed", lambda module: True)
    out = io.StringIO()
    assert quiet_startup(stream=out) == []
    logger = logging.getLogger(CUDA_LOGGER)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        for _ in range(2):
            logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/opt/cuda")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["something else"]
    assert out.getvalue() == "[snip] no CUDA runtime (CUDA_HOME=/opt/cuda is set): torch runs on the CPU\n"


def test_other_ranks_filter_but_do_not_print(fresh, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(startup, "_installed", lambda module: module != "absl")
    out = io.StringIO()
    assert quiet_startup(stream=out) == [ABSENCES[2].notice]
    warn_from("megatron.core.hyper_comm_grid", "absl.logging is not installed. Using logging.getLogger")
    assert out.getvalue() == "" and not fresh
