"""Runs read in place from an object store: a real S3 API (moto's server on 127.0.0.1) gives the
same JSON as the same files on disk for every command that takes a run, `--from` imports read
from it into the cache, and a missing bucket, a denied key, an object cut mid-write or a
server that dies mid-read each end in exit 2 naming the URL, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import polars as pl
import pytest
from conftest import GENUINE
from s3server import S3Server, s3_server
from typer.testing import CliRunner

from rlscope.cli import app
from rlscope.errors import RlscopeError
from rlscope.gates import snapshot_key
from rlscope.reader import open_run
from rlscope.store import (
    StorePath,
    arrow_source,
    is_url,
    location,
    polars_options,
    store_error,
)

ROOT = Path(__file__).resolve().parent.parent
HEALTHY = ROOT / "sample_logs" / "healthy"
COLLAPSE = ROOT / "sample_logs" / "entropy-collapse"
TRL = GENUINE / "trl-tiny-grpo"
VERL_METRICS = GENUINE / "verl-dapo" / "metrics-verl-0.7.jsonl"


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _json(*args: str) -> dict[str, Any]:
    done = _cli(*args, "--format", "json")
    assert done.exit_code in (0, 1), done.output
    return dict(json.loads(done.stdout))


def _normalised(doc: dict[str, Any], *paths: str) -> str:
    """The document's text with what names where a run was read left out (`paths`, the runs'
    paths or URLs, in order, and an import's notes naming its cache dir): everything else
    must be the same bytes."""
    doc = json.loads(json.dumps(doc))
    if "run" in doc and "path" in doc["run"]:
        doc["run"]["path"] = "RUN"
    if "notes" in doc:
        doc["notes"] = [n for n in doc["notes"] if not n.startswith("imported from")]
    text = json.dumps(doc, indent=2, sort_keys=True)
    for i, path in enumerate(paths):
        text = text.replace(json.dumps(path)[1:-1], f"RUN{i}")
    return text


@pytest.fixture
def store(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """The session's S3 server, with rlscope pointed at it (AWS_* variables) and a fresh
    cache dir."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RLSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    return s3


def _bucket(request: pytest.FixtureRequest) -> str:
    """A bucket per test (the server is the session's)."""
    name = request.node.name.lower().replace("_", "-")
    return "".join(c for c in name if c.isalnum() or c == "-")[:50].strip("-")


# URLs: one function decides what a location is and which library reads it.


def test_a_location_is_routed_by_its_scheme(tmp_path: Path) -> None:
    assert location("s3://bkt/runs/x/") == StorePath("s3", "bkt/runs/x")
    assert location("gs://bkt/runs/x") == StorePath("gs", "bkt/runs/x")
    assert location("gcs://bkt/runs/x") == StorePath("gs", "bkt/runs/x")
    assert location("az://container/runs/x") == StorePath("az", "container/runs/x")
    assert location("hf://datasets/org/name/run") == StorePath("hf", "datasets/org/name/run")
    assert location(f"file://{tmp_path}") == tmp_path
    assert location("runs/x") == Path("runs/x")
    assert is_url("s3://bkt/x") and not is_url("runs/x")
    for bad in ("ftp://host/run", "s3:///no-bucket"):
        with pytest.raises(RlscopeError):
            location(bad)
    run = StorePath("s3", "bkt/runs/x")
    file = run / "tokens" / "step=3" / "part-0.parquet"
    assert str(file) == "s3://bkt/runs/x/tokens/step=3/part-0.parquet"
    assert file.name == "part-0.parquet" and file.parent.name == "step=3"
    assert file.relative_to(run / "tokens") == PurePosixPath("step=3/part-0.parquet")
    # Polars reads the URL itself, with bounded retries and no credential passed; pyarrow the
    # key with the store's filesystem; a local file is read as it always was.
    assert polars_options(tmp_path) is None and arrow_source(tmp_path) == (str(tmp_path), None)
    assert polars_options(file) == {"max_retries": 2, "retry_timeout_ms": 60_000}


def test_each_store_has_its_own_pyarrow_filesystem(monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.fs as pafs

    from rlscope import store

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
    key, fs = arrow_source(StorePath("s3", "bkt/run/steps.parquet"))
    assert key == "bkt/run/steps.parquet" and isinstance(fs, pafs.S3FileSystem)
    assert isinstance(store.filesystem(StorePath("az", "container/run")), pafs.AzureFileSystem)
    assert isinstance(store.filesystem(StorePath("gs", "bkt/run")), pafs.GcsFileSystem)
    pytest.importorskip("huggingface_hub")
    assert isinstance(store.filesystem(StorePath("hf", "datasets/o/n/run")), pafs.PyFileSystem)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
    with pytest.raises(RlscopeError, match="AZURE_STORAGE_ACCOUNT_NAME"):
        store.filesystem(StorePath("az", "other/run"))


def test_a_stores_errors_say_the_cause() -> None:
    url = "s3://bkt/run"
    gone, silent = "the bucket does not exist", "the store did not answer"
    cases = {
        "AWS Error ACCESS_DENIED during GetObject operation": "access denied",
        "AWS Error INVALID_ACCESS_KEY_ID: The AWS Access Key Id you provided does not exist "
        "in our records. (Request ID: x)": "access denied",
        "AWS Error NO_SUCH_BUCKET: The specified bucket does not exist": gone,
        "curlCode: 7, Could not connect to server": silent,
        "Generic S3 error: Error after 2 retries ... error sending request": silent,
        "Path does not exist 'bkt/run/x.parquet'": "no such object",
    }
    for message, cause in cases.items():
        error = store_error(url, OSError(message))
        assert error.message.startswith(f"{url}: {cause}"), message
        assert "Request ID" not in error.message


# Every command on a run in the bucket: the same bytes as on disk.


def test_analyze_from_s3_is_the_same_json_as_from_disk(
    store: S3Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    bucket = _bucket(request)
    # A genuine trainer's run (TRL's completions), imported to format v1, and the sample run
    # with every table (tokens and probes too).
    genuine = tmp_path / "trl-tiny-grpo"
    assert _cli("import", "trl", str(TRL), str(genuine)).exit_code == 0
    for local in (HEALTHY, genuine):
        url = store.upload(local, bucket, f"runs/{local.name}")
        for cache in ("--no-cache", "--cache"):
            remote = _json("analyze", url, cache, "--fail-on", "never")
            assert remote["run"]["path"] == url
            on_disk = _json("analyze", str(local), cache, "--fail-on", "never")
            assert _normalised(remote) == _normalised(on_disk)


def test_every_command_reads_a_run_in_s3(
    store: S3Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    bucket = _bucket(request)
    healthy = store.upload(HEALTHY, bucket, "runs/healthy")
    collapse = store.upload(COLLAPSE, bucket, "runs/entropy-collapse")
    local = [str(HEALTHY), str(COLLAPSE)]
    pairs = [
        (["compare", healthy, collapse], ["compare", *local]),
        (["check", collapse, "--baseline", healthy], ["check", local[1], "--baseline", local[0]]),
        (
            ["rollouts", healthy, "--filter", "reward > 0.5"],
            ["rollouts", local[0], "--filter", "reward > 0.5"],
        ),
        (["show", healthy, "3"], ["show", local[0], "3"]),
    ]
    for remote_args, local_args in pairs:
        remote = _normalised(_json(*remote_args), healthy, collapse)
        assert remote == _normalised(_json(*local_args), *local), remote_args[0]
    # check --watch polls the bucket's listing: a file arriving changes it
    listed = snapshot_key(healthy)
    assert sorted(name for name, _, _ in listed) == sorted(
        p.relative_to(HEALTHY).as_posix() for p in HEALTHY.rglob("*") if p.is_file()
    )
    valid = _cli("validate", healthy)
    assert valid.exit_code == 0 and valid.stdout.startswith(f"{healthy}: valid format-v1 run")
    out = tmp_path / "report.html"
    assert _cli("report", healthy, collapse, "-o", str(out)).exit_code == 0
    assert out.stat().st_size > 10_000
    # Nothing is written into the bucket: probe appends to its run, import writes OUT.
    probe = _cli("probe", healthy, "--endpoint", "http://127.0.0.1:9/v1", "--model", "m")
    assert probe.exit_code == 2 and "never writes into a store" in probe.output
    into = _cli("import", "trl", str(TRL), f"s3://{bucket}/out")
    assert into.exit_code == 2 and "never writes into a store" in into.output
    keys = store.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert all(k["Key"].startswith(("runs/healthy/", "runs/entropy-collapse/")) for k in keys)


def test_from_imports_read_a_source_in_s3_into_the_cache(
    store: S3Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    bucket = _bucket(request)
    folder = store.upload(TRL, bucket, f"outputs/{TRL.name}")  # a folder: TRL's output dir
    store.upload(VERL_METRICS.parent, bucket, "verl-dapo")
    single = f"s3://{bucket}/verl-dapo/{VERL_METRICS.name}"  # one object: a metrics.jsonl
    for url, local, fmt in ((folder, TRL, "trl"), (single, VERL_METRICS, "verl-metrics")):
        remote = _json("analyze", url, "--from", fmt, "--fail-on", "never")
        on_disk = _json("analyze", str(local), "--from", fmt, "--fail-on", "never")
        assert _normalised(remote) == _normalised(on_disk), fmt
        assert remote["run"]["path"].startswith(str(tmp_path / "cache" / "imports"))
        assert any(n.startswith(f"imported from {fmt} {url} into") for n in remote["notes"])
    # Again: nothing new in the bucket, nothing fetched again (the copy's stamps match).
    copies = tmp_path / "cache" / "store-sources"
    before = {p: p.stat().st_mtime_ns for p in copies.rglob("*.parquet")}
    _json("analyze", folder, "--from", "trl", "--fail-on", "never")
    assert before and {p: p.stat().st_mtime_ns for p in copies.rglob("*.parquet")} == before


def test_no_boto3_is_needed_to_read_a_store(
    store: S3Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """boto3 is a test dependency only: rlscope reads S3 with pyarrow and Polars alone."""
    url = store.upload(HEALTHY, _bucket(request), "runs/healthy")
    code = (
        "import sys\n"
        "sys.modules['boto3'] = sys.modules['botocore'] = None  # an import of either fails\n"
        "from rlscope.cli import main\n"
        f"sys.argv = ['rlscope', 'analyze', {url!r}, '--format', 'json', '--no-cache']\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    on_disk = _json("analyze", str(HEALTHY), "--no-cache")
    assert _normalised(json.loads(done.stdout)) == _normalised(on_disk)


# The cache keyed by what the store says.


def test_a_growing_run_in_s3_reads_only_its_new_and_rewritten_objects(
    store: S3Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    bucket = _bucket(request)
    run = tmp_path / "run"
    shutil.copytree(HEALTHY, run)
    url = store.upload(run, bucket, "runs/live")
    first = _json("analyze", url, "--fail-on", "never")
    assert first["run"]["token_files"] == {"total": 1, "read": 1}
    again = _json("analyze", url, "--fail-on", "never")
    assert again["run"]["token_files"] == {"total": 1, "read": 0}
    assert all(t["read"] == 0 for t in again["run"]["table_files"].values())
    # One more step's token and steps files arrive (new objects under new names).
    tokens = pl.read_parquet(next((run / "tokens").glob("*.parquet")))
    steps = pl.read_parquet(next((run / "steps").glob("*.parquet")))
    last = int(steps["step"].max())
    grown = tmp_path / "grown"
    (grown / "tokens").mkdir(parents=True)
    (grown / "steps").mkdir()
    tokens.filter(pl.col("step") == last).with_columns(step=pl.lit(last + 1)).write_parquet(
        grown / "tokens" / "r000-999999.parquet"
    )
    steps.filter(pl.col("step") == last).with_columns(step=pl.lit(last + 1)).write_parquet(
        grown / "steps" / "r000-999999.parquet"
    )
    store.upload(grown, bucket, "runs/live")
    after = _json("analyze", url, "--fail-on", "never")
    assert after["run"]["token_files"] == {"total": 2, "read": 1}
    assert after["run"]["table_files"]["steps"] == {"total": 2, "read": 1}
    assert after["run"]["table_files"]["rollouts"]["read"] == 0
    # The same analysis as a fresh cache's.
    fresh = _json("analyze", url, "--no-cache", "--fail-on", "never")
    assert _normalised(_files_read_dropped(after)) == _normalised(_files_read_dropped(fresh))
    # The token file rewritten under its name (most likely within the same second as its
    # first upload, which the listing's time cannot tell apart: its ETag does): read again,
    # and its new values are those analysed.
    (original,) = (run / "tokens").glob("*.parquet")
    rewritten = tmp_path / "rewritten"
    (rewritten / "tokens").mkdir(parents=True)
    changed = tokens.with_columns(pl.col("entropy") * 0.5)
    changed.write_parquet(rewritten / "tokens" / original.name)
    before = open_run(url).tables["tokens"]
    store.upload(rewritten, bucket, "runs/live")
    now = open_run(url).tables["tokens"]
    i = [p.name for p in now.files].index(original.name)
    assert now.file_stats[i][2] != before.file_stats[i][2]  # the ETag's digest: in the key
    third = _json("analyze", url, "--fail-on", "never")
    assert third["run"]["token_files"] == {"total": 2, "read": 1}
    cold = _json("analyze", url, "--no-cache", "--fail-on", "never")
    assert _normalised(_files_read_dropped(third)) == _normalised(_files_read_dropped(cold))
    assert third["metrics"] != after["metrics"]


def _files_read_dropped(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    doc["run"].pop("token_files")
    doc["run"].pop("table_files")
    return doc


# Errors: exit 2, the URL named, no traceback.


def _fails(*args: str) -> str:
    done = _cli(*args)
    assert done.exit_code == 2, done.output
    assert isinstance(done.exception, SystemExit)  # the CLI's own exit, not an exception
    assert "Traceback" not in done.output
    return str(done.output)


def test_a_missing_bucket_or_run_is_a_clear_error(
    store: S3Server, request: pytest.FixtureRequest
) -> None:
    out = _fails("analyze", "s3://no-such-bucket/runs/x")
    assert "s3://no-such-bucket/runs/x: the bucket does not exist" in out
    bucket = _bucket(request)
    store.upload(HEALTHY, bucket, "runs/healthy")
    out = _fails("analyze", f"s3://{bucket}/runs/nothing-here")
    assert f"s3://{bucket}/runs/nothing-here: no such run" in out
    out = _fails("analyze", f"s3://{bucket}/runs/nothing-here", "--from", "trl")
    assert "no such object or folder" in out


def test_an_object_cut_mid_write_is_named(
    store: S3Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(HEALTHY, run)
    (cut,) = (run / "rollouts").glob("*.parquet")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    url = store.upload(run, _bucket(request), "runs/cut")
    out = _fails("analyze", url)
    assert f"{url}/rollouts/{cut.name}: not a readable Parquet file" in out
    assert "cut mid-write" in out


def test_bad_credentials_are_a_clear_error_and_never_printed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("moto.server")
    n_files = sum(1 for p in HEALTHY.rglob("*") if p.is_file())
    # moto checks credentials after the first N requests: those of the upload (list and make
    # the bucket, a put per file) pass, then every request needs a key it knows.
    with s3_server({"INITIAL_NO_AUTH_ACTION_COUNT": str(2 + n_files)}) as server:
        url = server.upload(HEALTHY, "bkt", "runs/healthy")
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEY")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-42")
        monkeypatch.setenv("RLSCOPE_CACHE_DIR", str(tmp_path / "cache"))
        out = _fails("analyze", url)
    assert f"{url}: access denied" in out and "AWS_ACCESS_KEY_ID" in out
    assert "not-the-secret-42" not in out and "AKIANOTAKEY" not in out


def test_a_server_that_dies_mid_read_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("moto.server")
    from rlscope import analysis

    with s3_server() as server:
        url = server.upload(HEALTHY, "bkt", "runs/healthy")
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("RLSCOPE_CACHE_DIR", str(tmp_path / "cache"))
        opened = analysis.open_run

        def open_then_die(*args: Any, **options: Any) -> Any:
            run = opened(*args, **options)  # listed, every footer read: the data is next
            server.stop()
            return run

        monkeypatch.setattr(analysis, "open_run", open_then_die)
        out = _fails("analyze", url, "--no-cache")
    assert f"{url}: the store did not answer" in out
    assert "tried 3 times" in out


def test_a_store_objects_footer_is_fetched_once_while_its_version_holds(
    store: S3Server, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the footer memo, re-opening a run in a bucket asks only each object's version (a
    HEAD), fetches no footer, and opens the same tables; an object rewritten under its name
    (its ETag changes, its listed time may not) has its footer fetched again."""
    import pyarrow.parquet as pq

    from rlscope.cache import FooterCache

    bucket = _bucket(request)
    run = tmp_path / "run"
    shutil.copytree(HEALTHY, run)
    url = store.upload(run, bucket, "runs/memo")
    memo = FooterCache(tmp_path / "cache")
    fetched: list[str] = []
    read_metadata = pq.read_metadata

    def counted(where: Any, *args: Any, **kwargs: Any) -> Any:
        fetched.append(str(getattr(where, "path", where)))
        return read_metadata(where, *args, **kwargs)

    monkeypatch.setattr(pq, "read_metadata", counted)
    first = open_run(url, memo=memo)
    objects = sum(len(t.files) for t in first.tables.values())
    assert len(fetched) == objects
    fetched.clear()
    assert open_run(url, memo=memo).tables == first.tables
    assert fetched == []
    (original,) = (run / "tokens").glob("*.parquet")
    rewritten = tmp_path / "rewritten"
    (rewritten / "tokens").mkdir(parents=True)
    pl.read_parquet(original).head(10).write_parquet(rewritten / "tokens" / original.name)
    store.upload(rewritten, bucket, "runs/memo")
    again = open_run(url, memo=memo)
    assert len(fetched) == 1
    assert again.tables["tokens"].file_rows == (10,)
    assert again.tables == open_run(url).tables
