"""NCCL links (open_link / close_link on the Regions stream) where a CPU daemon serves: the commands
are answered over the stream, which stays open. The cpu backend has no links: open_link is
UNIMPLEMENTED saying to start moed with the cuda backend (so is one where NCCL does not load);
`--max-links 0` turns links off: FAILED_PRECONDITION naming the flag; close_link of a link this
session does not have is NOT_FOUND. The calls themselves need two GPUs' NCCL: test_link_srv drives
server/link.c over faked links, and the GPU tests over NCCL.
"""

import oracle as O
from conftest import Daemon
from regions import Session

from moed._proto.moed.v1 import moed_pb2 as pb

SPEC = O.Spec(layers=1, d=32, ff=64, experts=4, topk=2, seed=5)
NOT_FOUND, PRECONDITION, UNIMPLEMENTED = 5, 9, 12


def open_link(s, **kw):
    return s.command(open_link=pb.OpenLink(**({"max_tokens": 16, "max_top_k": 2} | kw)))


def test_cpu_daemon_has_no_links(tmp_path):
    d = Daemon(["--synthetic", str(SPEC), "--threads", "1"], tmp_path / "moed.log")
    try:
        with d.channel() as ch:
            s = Session(ch)
            ev = open_link(s)
            assert ev.code == UNIMPLEMENTED, ev
            assert "start moed with the cuda backend" in ev.message, ev
            assert not ev.HasField("link")
            ev = s.command(close_link=pb.CloseLink(link=12345))
            assert ev.code == NOT_FOUND and "not an open link of this session" in ev.message, ev
            ev = open_link(s, max_tokens=0)  # the stream is still open, and the request checked
            assert ev.code == 3 and "open_link.max_tokens" in ev.message, ev
            s.close()
    finally:
        assert d.stop() == 0, d.log()


def test_links_off(tmp_path):
    d = Daemon(["--synthetic", str(SPEC), "--threads", "1", "--max-links", "0"], tmp_path / "moed.log")
    try:
        with d.channel() as ch:
            s = Session(ch)
            for ev in (open_link(s), s.command(close_link=pb.CloseLink(link=1))):
                assert ev.code == PRECONDITION and "--max-links 0" in ev.message, ev
            s.close()
    finally:
        assert d.stop() == 0, d.log()
