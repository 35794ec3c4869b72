"""Start-up existence checks over HTTP against a 127.0.0.1 server that answers 503, or drops
the connection, now and then: the checks retry with the streaming reader's back-off and the
loader reads every sample; a shard that never answers is "unreachable" (with the reason), not
"missing"; a 404 is still "missing", without retries."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import RangeHandler, http_server, run_tool

from shardflow import image_loader
from shardflow.builtin import make_image_folder as builtin_images
from shardflow.loading import fetch

OPTS = {"size": 32, "threads": 1, "shuffle_buffer": 16}
SHARDS = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 images, 5 per shard: 8 shards, train-000000.tar .. train-000007.tar."""
    root = tmp_path_factory.mktemp("flaky")
    src = builtin_images(root / "src", per_class=4, size=32)
    run_tool("make_shards", "imagefolder", src, root / "out", "--max-count", 5, check=True)
    assert len(list((root / "out").glob("*.tar"))) == SHARDS
    return root / "out"


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardflow import urls

    monkeypatch.setattr(urls, "BACKOFF_S", 0.01)
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)


class Flaky(RangeHandler):
    """Per shard path, the first `fail_first` requests (HEAD or GET) fail: `how` is "503" (an
    HTTP answer) or "reset" (the connection closed before any answer); paths named in
    `always` fail every time. Requests are counted per path."""

    fail_first = 0
    how = "503"
    always: frozenset[str] = frozenset()
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def _fails(self) -> bool:
        name = self.path.split("?")[0].rsplit("/", 1)[-1]
        if not name.endswith(".tar"):
            return False
        with self.lock:
            self.seen[name] = self.seen.get(name, 0) + 1
            return name in self.always or self.seen[name] <= self.fail_first

    def _fail(self) -> None:
        if self.how == "reset":
            self.close_connection = True  # no status line: the client sees a disconnect
            return
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.send_header("Retry-After", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        return self._fail() if self._fails() else super().do_HEAD()

    def do_GET(self) -> None:
        return self._fail() if self._fails() else super().do_GET()


def flaky(fail_first: int = 0, how: str = "503", always: frozenset[str] = frozenset()
          ) -> type[Flaky]:
    return type("FlakyNow", (Flaky,), {"fail_first": fail_first, "how": how,
                                       "always": always, "seen": {}})


def keys_of(loader) -> list[str]:
    return [k for batch in loader for k in batch.keys]


def pattern(base: str) -> str:
    return f"{base}/train-{{000000..{SHARDS - 1:06d}}}.tar"


@pytest.mark.parametrize("how", ["503", "reset"])
def test_a_transient_failure_at_start_up_is_retried_and_nothing_is_lost(shards, how, caplog):
    local = sorted(keys_of(image_loader(shards, batch_size=8, train=False, device="cpu",
                                        **OPTS)))
    # fsspec's info tries HEAD then GET, and aiohttp itself tries a dropped request again:
    # enough failures that our retry must step in
    fails = 2 if how == "503" else 6
    handler = flaky(fail_first=fails, how=how)
    with http_server(shards, handler) as base:
        loader = image_loader(pattern(base), batch_size=8, train=False, device="cpu", **OPTS)
        remote = sorted(keys_of(loader))
    assert remote == local and len(local) == 40
    assert not loader.skipped
    assert all(handler.seen[f"train-{i:06d}.tar"] > fails for i in range(SHARDS))
    assert "checking" in caplog.text and "try 2 of 4" in caplog.text


def test_a_shard_that_never_answers_is_unreachable_not_missing(shards):
    handler = flaky(always=frozenset({"train-000003.tar"}))
    with http_server(shards, handler) as base, pytest.raises(ConnectionError) as info:
        image_loader(pattern(base), batch_size=8, device="cpu", **OPTS)
    message = str(info.value)
    assert f"1 of {SHARDS} shards are unreachable (HTTP 503 after 4 tries)" in message
    assert "train-000003.tar" in message and "missing" not in message
    assert handler.seen["train-000003.tar"] >= 4  # each try reached the server


def test_a_404_is_missing_at_once(shards):
    handler = flaky()
    with http_server(shards, handler) as base, pytest.raises(FileNotFoundError) as info:
        image_loader(base + "/train-{000006..000009}.tar", batch_size=8, device="cpu", **OPTS)
    assert "2 of 4 shards are missing" in str(info.value)
    assert "000008" in str(info.value) and "000009" in str(info.value)
    # HEAD then GET (fsspec's info), no retries: a 404 is an answer
    assert handler.seen["train-000008.tar"] <= 2


def test_the_transient_test_sees_the_bug_it_guards(shards, monkeypatch):
    """With fsspec's exists (False on a 503), the old check called a shard behind a hiccup
    missing: the planted bug this file's first test fails on."""
    from shardflow.shards import listing

    monkeypatch.setattr(listing, "_exists",
                        lambda url, options: bool(listing.fsspec.core.url_to_fs(url)[0]
                                                  .exists(url)))
    with http_server(shards, flaky(fail_first=2)) as base, \
            pytest.raises(FileNotFoundError, match=f"{SHARDS} of {SHARDS} shards are missing"):
        image_loader(pattern(base), batch_size=8, device="cpu", **OPTS)
