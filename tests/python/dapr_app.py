"""A Dapr pub/sub app written only from Dapr's documentation (Python standard library).

Usage: dapr_app.py PORT TOPIC
It declares its subscription programmatically (GET /dapr/subscribe) with routing rules, takes
CloudEvents on the routes it declared, answers with Dapr's statuses, and publishes through the
Dapr HTTP API at DAPR_HTTP_PORT (one event, and in bulk), as Dapr's own samples do. It knows nothing of cosmosq.
Prints one JSON line per event it receives: {"route", "id", "pubsubname", "topic", "data"}.
"""
import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PUBSUB = "pubsub"
PORT = int(sys.argv[1])
TOPIC = sys.argv[2]
DAPR = "http://localhost:{}".format(os.environ.get("DAPR_HTTP_PORT", "3500"))
ROUTES = ("/widgets", "/urgent", "/orders")
failed_once = set()
printing = threading.Lock()


def record(line):
    # One write per line: the server answers on several threads.
    with printing:
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


def subscriptions():
    # "Programmatic subscriptions": the app returns its subscriptions as JSON.
    return [
        {
            "pubsubname": PUBSUB,
            "topic": TOPIC,
            "routes": {
                "rules": [
                    {"match": 'event.data.kind == "widget"', "path": "/widgets"},
                    {"match": "event.data.priority > 5", "path": "/urgent"},
                ],
                "default": "/orders",
            },
        }
    ]


def post_json(path, payload):
    request = urllib.request.Request(
        DAPR + path,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def publish(data):
    # "Publish a message": POST /v1.0/publish/<pubsub-name>/<topic>.
    return post_json("/v1.0/publish/{}/{}".format(PUBSUB, TOPIC), data)


def publish_bulk(entries):
    # "Bulk publish": POST /v1.0-alpha1/publish/bulk/<pubsub-name>/<topic>.
    return post_json("/v1.0-alpha1/publish/bulk/{}/{}".format(PUBSUB, TOPIC), entries)


class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body):
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        if self.path == "/dapr/subscribe":
            self.reply(200, subscriptions())
        else:
            self.reply(404, {})

    def do_POST(self):
        if self.path not in ROUTES:
            self.reply(404, {})
            return
        length = int(self.headers.get("Content-Length", "0"))
        event = json.loads(self.rfile.read(length))
        data = event.get("data")
        fields = data if isinstance(data, dict) else {}
        record(
            {
                "route": self.path,
                "id": event.get("id"),
                "pubsubname": event.get("pubsubname"),
                "topic": event.get("topic"),
                "data": data,
            }
        )
        # Dapr's statuses: SUCCESS, RETRY, DROP.
        if fields.get("flaky") and event["id"] not in failed_once:
            failed_once.add(event["id"])
            self.reply(200, {"status": "RETRY"})
            return
        if fields.get("drop"):
            self.reply(200, {"status": "DROP"})
            return
        if fields.get("publish"):
            status = publish({"kind": "widget", "from": "app"})
            if status != 204:
                self.reply(500, {"error": "publish answered {}".format(status)})
                return
        if fields.get("bulk"):
            status = publish_bulk(
                [
                    {"entryId": "1", "event": "bulk text", "contentType": "text/plain"},
                    {"entryId": "2", "event": {"kind": "widget", "from": "bulk"},
                     "contentType": "application/json"},
                ]
            )
            if status != 204:
                self.reply(500, {"error": "bulk publish answered {}".format(status)})
                return
        self.reply(200, {"status": "SUCCESS"})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
