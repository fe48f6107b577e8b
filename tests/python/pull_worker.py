"""A worker that only pulls (Python standard library), as a Storage Queue or SQS worker would.

Usage: pull_worker.py API work EXPECTED   receive in batches until EXPECTED messages are settled
       pull_worker.py API crash           receive one batch, then die without settling any

Messages are {"fate": "ok" | "abandon-once" | "dead"}: "ok" is completed with its batch
(POST /v1/settle), "abandon-once" is abandoned on its first delivery to this worker and
completed on the next, "dead" is dead-lettered. Prints one JSON line per message received:
{"id", "deliveryCount", "action"}.
"""
import json
import os
import sys
import urllib.request

API = sys.argv[1]


def post(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(API + path, data=data, method="POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read()
        return response.status, (json.loads(text) if text else None)


def receive(max_messages, visibility):
    _, answer = post("/v1/receive?max={}&visibility={}&wait=5s".format(max_messages, visibility))
    return answer["messages"]


def say(message, action):
    line = {"id": message["messageId"], "deliveryCount": message["deliveryCount"], "action": action}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def crash():
    batch = receive(5, "1s")
    for message in batch:
        say(message, "received")
    os._exit(1)


def work(expected):
    settled = set()
    abandoned = set()
    while len(settled) < expected:
        batch = receive(10, "30s")
        completions = []
        for message in batch:
            fate = message["body"]["fate"]
            token = message["lockToken"]
            if fate == "dead":
                status, _ = post("/v1/messages/{}/dead-letter".format(token), {"reason": "bad order"})
                assert status == 204, status
                say(message, "dead-letter")
                settled.add(message["messageId"])
            elif fate == "abandon-once" and message["messageId"] not in abandoned:
                status, _ = post("/v1/messages/{}/abandon".format(token), {"delay": 0, "reason": "busy"})
                assert status == 204, status
                abandoned.add(message["messageId"])
                say(message, "abandon")
            else:
                # Long work renews its lock first, as a worker holding a message would.
                status, renewed = post("/v1/messages/{}/renew?visibility=30s".format(token))
                assert status == 200 and "lockedUntil" in renewed, (status, renewed)
                completions.append({"lockToken": token, "action": "complete"})
                say(message, "complete")
                settled.add(message["messageId"])
        if completions:
            _, answer = post("/v1/settle", completions)
            refused = [r for r in answer["results"] if not r.get("settled")]
            assert not refused, refused


if sys.argv[2] == "crash":
    crash()
else:
    work(int(sys.argv[3]))
