from vllm_xpu_memfix.cli.demo import ledger_report, plugin_lines

LOG = """\
(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'model': 'vllm-xpu-memfix-demo/model'}
(EngineCore pid=2) INFO [__init__.py:61] vllm-xpu-memfix 0.1.0 registered (pid=2 role=engine_core)
(Worker pid=3) INFO [host_release.py:119] vllm-xpu-memfix: rank 0 host release: RssAnon 429 -> 429
(Worker pid=3) INFO [ledger.py:152] vllm-xpu-memfix: host-memory ledger, rank 0 (worker-0), MiB
(Worker pid=3) INFO [ledger.py:154] phase   t (s)  RssAnon
(EngineCore pid=2) INFO [core.py:9] a line of another process between the rows
(Worker pid=3) INFO [ledger.py:154] ready     4.3    1,453
(Worker pid=3) INFO [ledger.py:156] vllm-xpu-memfix: rank 0 attribution since start: anon +1 MiB
(Worker pid=3) INFO [ledger.py:156] vllm-xpu-memfix: rank 0 likely cause: none
(Worker pid=3) INFO [core.py:1] loaded vllm-xpu-memfix-demo/model
"""


def test_plugin_lines_are_the_plugins_own_messages_only():
    lines = plugin_lines(LOG)
    assert len(lines) == 5
    assert not any(
        "non-default args" in line or "loaded vllm-xpu-memfix-demo" in line for line in lines
    )


def test_ledger_report_is_the_workers_table_through_the_likely_cause():
    report = ledger_report(LOG)
    assert report[0].endswith("host-memory ledger, rank 0 (worker-0), MiB")
    assert report[-1].endswith("likely cause: none") and len(report) == 5
    assert not any("another process" in line for line in report)
