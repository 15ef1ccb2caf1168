"""The trainer's progress: a tqdm bar on a terminal, one log line per step elsewhere; both say
step/total, loss, tau, tau_sim, lr, tokens/s and the feature queue's depth."""

import io
import logging

from dflash.train.progress import Progress

RECORD = {
    "step": 3,
    "loss": 1.23456,
    "tau": 2.5,
    "tau_sim": 2.25,
    "tau_sim_first": 2.125,
    "lr": 1e-3,
    "tokens_per_s": 1234.4,
    "queue_depth": {"1": 1.0, "2": 2.0},
}
SAID = "loss 1.2346 tau 2.500 tau_sim 2.250 (first answers 2.125) lr 1.00e-03 1234 tok/s queue 1.5"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_without_a_terminal_each_step_is_a_log_line(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    log = logging.getLogger("dflash.train.trainer")
    progress = Progress(10, 2, log)
    with caplog.at_level(logging.INFO, logger=log.name):
        progress.update(RECORD)
    progress.close()
    assert [r.getMessage() for r in caplog.records] == [f"step 3/10 {SAID}"]


def test_on_a_terminal_a_bar_says_the_same(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", Terminal())
    progress = Progress(10, 2, logging.getLogger("dflash.train.trainer"))
    shown = []
    with caplog.at_level(logging.INFO):
        for record in (RECORD, RECORD | {"step": 4, "queue_depth": {}}):
            progress.update(record)
            shown.append(str(progress.bar))  # the bar as drawn (tqdm draws at most 10 a second)
    progress.close()
    assert "3/10" in shown[0] and SAID in shown[0]
    assert "4/10" in shown[1] and SAID.removesuffix(" queue 1.5") + "]" in shown[1]
    assert caplog.records == []
