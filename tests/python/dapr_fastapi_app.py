"""A Dapr pub/sub app on the official Python SDK's FastAPI extension (`dapr-ext-fastapi` from
PyPI, unchanged), written from its documentation: `DaprApp(app).subscribe(pubsub, topic)`
registers the subscription (`GET /dapr/subscribe`) and its handler, which takes the CloudEvent
as the request body. A handler that raises makes FastAPI answer 500, which Dapr retries; the
first delivery of a message whose data says `flaky` raises once. It knows nothing of cosmosq.

Usage: dapr_fastapi_app.py PORT TOPIC
Prints one JSON line per event handled: {"id", "data", "pubsubname", "topic"}, and
{"step": "failed once", "id"} for the flaky one's first delivery.
"""
import json
import sys
import threading

import uvicorn
from dapr.ext.fastapi import DaprApp
from fastapi import Body, FastAPI

PORT = int(sys.argv[1])
TOPIC = sys.argv[2]

app = FastAPI()
dapr_app = DaprApp(app)
failed_once = set()
# FastAPI runs plain `def` handlers on a thread pool: one line at a time.
printing = threading.Lock()


def say(line):
    with printing:
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


@dapr_app.subscribe(pubsub="pubsub", topic=TOPIC)
def orders(event=Body()):
    data = event.get("data")
    if isinstance(data, dict) and data.get("flaky") and event["id"] not in failed_once:
        failed_once.add(event["id"])
        say({"step": "failed once", "id": event["id"]})
        raise RuntimeError("a flaky handler")
    say({
        "id": event["id"],
        "data": data,
        "pubsubname": event.get("pubsubname"),
        "topic": event.get("topic"),
    })
    return {"status": "SUCCESS"}


uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
