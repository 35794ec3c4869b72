from __future__ import annotations

import pytest

from shardflow.urls import check_scheme, expand_braces, is_remote, redact


def test_brace_range_keeps_zero_padding():
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]


def test_brace_list_and_nested_groups():
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]


@pytest.mark.parametrize("bad", ["s-{000...002}.tar", "s-{5..1}.tar", "s-{abc}.tar"])
def test_brace_typos_are_named(bad):
    with pytest.raises(ValueError, match="brace"):
        expand_braces(bad)


def test_pipe_urls_refused_unless_allowed():
    with pytest.raises(ValueError, match="pipe:"):
        check_scheme("pipe:curl http://x/a.tar")
    assert check_scheme("pipe:cat a.tar", allow_pipe=True) == "pipe:cat a.tar"


def test_credentials_are_redacted():
    url = "https://alice:s3cret@host.example/a.tar?X-Amz-Signature=abc&part=1&token=zz"
    out = redact(url)
    assert "alice" not in out and "s3cret" not in out and "abc" not in out and "zz" not in out
    assert "part=1" in out and out.startswith("https://***@host.example/a.tar")


def test_local_paths_are_not_remote():
    assert not is_remote("/data/a.tar") and not is_remote("C:/data/a.tar")
    assert is_remote("s3://bucket/a.tar") and is_remote("memory://x/a.tar")


def test_the_index_beside_a_shard_keeps_the_query_string():
    from shardflow.urls import beside

    assert beside("shards/a-000001.tar", ".idx") == "shards/a-000001.idx"
    assert beside("https://h/x/a.tar?token=t&v=1", ".idx") == "https://h/x/a.idx?token=t&v=1"
    assert beside("s3://b/a.tar.gz", ".idx") == "s3://b/a.tar.gz.idx"
