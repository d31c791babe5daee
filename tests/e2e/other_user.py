"""A moed client driven line by line, for tests that need a caller of another local user
(test_region_owners.py starts it as uid 65534): one process, one channel (one connection), so what
the daemon decides about its principal is decided about this process.

    other_user.py UID TARGET [TOKEN]

It becomes UID (setgid, setuid) before it opens anything: the interpreter it runs in may live
where only root can read (pyenv under /root), so it starts as root and drops privileges itself.

Each line on stdin is a JSON object, answered by one JSON line on stdout:

    {"op": "list"}                               -> {"ids": [...]}
    {"op": "register", "bytes": N}               -> {"id": ID, "name": NAME}  (its own shared memory,
                                                     created by this process, on a session it keeps)
    {"op": "put", "id": ID, "offset": O, "data": B64} / {"op": "get", "id": ID, "offset": O, "n": N}
                                                 -> {} / {"data": B64}       (in its own memory)
    {"op": "forward", "request": B64}            -> {"data": B64}            (a ForwardRequest)

A call that fails answers {"code": NAME, "message": DETAILS} instead.
"""

import base64
import json
import os
import sys

import grpc

from regions import Session, Shm, list_regions, unary

from moed._proto.moed.v1 import moed_pb2 as pb


def main():
    uid, target = int(sys.argv[1]), sys.argv[2]
    md = [("authorization", f"Bearer {sys.argv[3]}")] if len(sys.argv) > 3 else []
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    channel = grpc.insecure_channel(target)
    session, shms = None, {}
    forward = unary(channel, "Forward", pb.ForwardRequest, pb.ForwardResponse)
    try:
        for line in sys.stdin:
            op = json.loads(line)
            try:
                if op["op"] == "list":
                    out = {"ids": [r.id for r in list_regions(channel, md)]}
                elif op["op"] == "register":
                    session = session or Session(channel, md)
                    shm = Shm(op["bytes"])
                    region = session.host(shm)
                    shms[region] = shm
                    out = {"id": region, "name": shm.name}
                elif op["op"] == "put":
                    shms[op["id"]].put(op["offset"], base64.b64decode(op["data"]))
                    out = {}
                elif op["op"] == "get":
                    data = shms[op["id"]].get(op["offset"], op["n"])
                    out = {"data": base64.b64encode(data).decode()}
                else:
                    q = pb.ForwardRequest.FromString(base64.b64decode(op["request"]))
                    r = forward(q, metadata=md, timeout=30)
                    out = {"data": base64.b64encode(r.output.data).decode()}
            except grpc.RpcError as e:
                out = {"code": e.code().name, "message": e.details()}
            print(json.dumps(out), flush=True)
    finally:
        for shm in shms.values():
            shm.close()


if __name__ == "__main__":
    main()
