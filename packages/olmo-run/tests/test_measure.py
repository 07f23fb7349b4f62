"""The CPU MFU peak (``olmo_run.measure``): a size^3 matmul timed once per machine and kept
under $OLMO_CACHE/matmul-peak, so that runs on one machine divide by the same figure. The clock
is a fake one that each matmul call advances by a known time, so the peak is known exactly."""

from __future__ import annotations

import json
import sys
import types

import pytest

from olmo_run import measure


class FakeMatmul:
    """A matmul that "takes" ``seconds`` on the fake clock; counts its calls."""

    def __init__(self, clock: list[float], seconds: float):
        self.clock, self.seconds, self.calls = clock, seconds, 0

    def __call__(self, size: int):
        assert size == 1024

        def run() -> None:
            self.calls += 1
            self.clock[0] += self.seconds

        return run


@pytest.fixture
def clock(monkeypatch, tmp_path):
    now = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))
    return now


def test_the_peak_is_measured_once_per_key_and_then_read(clock, tmp_path, monkeypatch):
    # The key reads torch's threads only where torch is loaded; an earlier test in this worker may
    # have loaded it (with one thread), so the first keys here are made without it.
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    matmul = FakeMatmul(clock, 0.01)
    peak, label = measure.device_peak(None, matmul)
    # 2 * 1024^3 FLOPs in 0.01 s: 214.7483648 GFLOP/s; one untimed warm-up call and 5 timed
    assert peak == pytest.approx(2 * 1024**3 / 0.01, rel=1e-9) and matmul.calls == 6
    assert label.startswith("measured cpu fp32 matmul 214.7 GFLOP/s (kept since ")
    (entry,) = (tmp_path / "cache" / "matmul-peak").glob("*.json")
    kept = json.loads(entry.read_text())
    assert kept["key"]["cpu"] == measure.cpu_model() and kept["key"]["matmul"].endswith("FakeMatmul")
    assert kept["flops"] == peak
    # The second run reads it: no matmul runs, even one that would now time slower.
    slower = FakeMatmul(clock, 0.02)
    assert measure.device_peak(None, slower) == (peak, label) and slower.calls == 0
    # Deleting the file measures again.
    entry.unlink()
    again = FakeMatmul(clock, 0.01)
    assert measure.device_peak(None, again)[0] == pytest.approx(peak, rel=1e-9) and again.calls == 6
    # Another CPU (or core count, thread setting, framework's matmul) measures its own.
    monkeypatch.setattr(measure, "cpu_model", lambda: "Another CPU 9000")
    assert measure.device_peak(None, slower)[0] == pytest.approx(2 * 1024**3 / 0.02, rel=1e-9)
    assert slower.calls == 6 and len(list((tmp_path / "cache" / "matmul-peak").glob("*.json"))) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert measure.peak_cache_key(slower)["settings"]["OMP_NUM_THREADS"] == "3"
    measure.device_peak(None, slower)
    assert slower.calls == 12 and len(list((tmp_path / "cache" / "matmul-peak").glob("*.json"))) == 3
    # torch's intra-op threads, where the process uses torch (a test's one thread, say)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 1))
    assert measure.peak_cache_key(slower)["settings"]["torch_threads"] == "1"
    measure.device_peak(None, slower)
    assert slower.calls == 18


def test_a_damaged_cache_file_is_measured_again_and_an_accelerator_reads_the_table(clock, tmp_path):
    matmul = FakeMatmul(clock, 0.01)
    path = measure.peak_cache_file(measure.peak_cache_key(matmul))
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert measure.device_peak(None, matmul)[0] == pytest.approx(2 * 1024**3 / 0.01, rel=1e-9)
    assert matmul.calls == 6 and json.loads(path.read_text())["flops"] == pytest.approx(2 * 1024**3 / 0.01)
    # H100 SXM: 989 TFLOP/s dense bf16 (NVIDIA's datasheet); no matmul timed, nothing kept
    other = FakeMatmul(clock, 0.01)
    peak, label = measure.device_peak("NVIDIA H100 80GB HBM3", other)
    assert peak == pytest.approx(989e12, rel=1e-3) and other.calls == 0 and "TFLOP/s" in label
