"""A Dapr pub/sub app written only from Dapr's documentation (Python standard library).

Usage: dapr_app.py PORT TOPIC [bulk]
It declares its subscription programmatically (GET /dapr/subscribe) with routing rules, takes
CloudEvents on the routes it declared, answers with Dapr's statuses, and publishes through the
Dapr HTTP API at DAPR_HTTP_PORT (one event, and in bulk), as Dapr's own samples do. It knows nothing of cosmosq.
With "bulk" it subscribes with bulkSubscribe (at most 5 entries a request, 300 ms) and answers
each request's entries with per-entry statuses, as Dapr's bulk subscribe documents.
With APP_API_TOKEN set it refuses (401) any request not carrying it in `dapr-api-token`, and
with DAPR_API_TOKEN set it presents that on its calls to the Dapr API, as Dapr's "API token
authentication" pages document.
Prints one JSON line per event it receives: {"route", "id", "pubsubname", "topic", "data",
"batch"} (batch: the entries of the request it came in; 1 without bulk).
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
BULK = len(sys.argv) > 3 and sys.argv[3] == "bulk"
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
    subscription = {
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
    if BULK:
        # "Bulk subscribe": messages arrive together, answered entry by entry.
        subscription["bulkSubscribe"] = {
            "enabled": True,
            "maxMessagesCount": 5,
            "maxAwaitDurationMs": 300,
        }
    return [subscription]


# "Enable API token authentication in Dapr": the app sends DAPR_API_TOKEN as dapr-api-token.
# "Authenticate requests from Dapr using token authentication": Dapr sends APP_API_TOKEN.
DAPR_API_TOKEN = os.environ.get("DAPR_API_TOKEN")
APP_API_TOKEN = os.environ.get("APP_API_TOKEN")


def post_json(path, payload):
    headers = {"Content-Type": "application/json"}
    if DAPR_API_TOKEN:
        headers["dapr-api-token"] = DAPR_API_TOKEN
    request = urllib.request.Request(
        DAPR + path,
        data=json.dumps(payload).encode(),
        headers=headers,
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

    def from_dapr(self):
        if APP_API_TOKEN and self.headers.get("dapr-api-token") != APP_API_TOKEN:
            self.reply(401, {"error": "not from my Dapr sidecar"})
            return False
        return True

    def do_GET(self):
        if not self.from_dapr():
            return
        if self.path == "/dapr/subscribe":
            self.reply(200, subscriptions())
        else:
            self.reply(404, {})

    def do_POST(self):
        if not self.from_dapr():
            return
        if self.path not in ROUTES:
            self.reply(404, {})
            return
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length))
        if body.get("type") == "com.dapr.event.sent.bulk":
            entries = body.get("entries", [])
            statuses = [
                {"entryId": entry["entryId"], "status": self.take(entry["event"], len(entries))}
                for entry in entries
            ]
            self.reply(200, {"statuses": statuses})
            return
        status = self.take(body, 1)
        if status == "ERROR":
            self.reply(500, {"error": "publishing failed"})
        else:
            self.reply(200, {"status": status})

    def take(self, event, batch):
        data = event.get("data")
        fields = data if isinstance(data, dict) else {}
        record(
            {
                "route": self.path,
                "id": event.get("id"),
                "pubsubname": event.get("pubsubname"),
                "topic": event.get("topic"),
                "data": data,
                "batch": batch,
            }
        )
        # Dapr's statuses: SUCCESS, RETRY, DROP.
        if fields.get("flaky") and event["id"] not in failed_once:
            failed_once.add(event["id"])
            return "RETRY"
        if fields.get("drop"):
            return "DROP"
        if fields.get("publish"):
            if publish({"kind": "widget", "from": "app"}) != 204:
                return "ERROR" if batch == 1 else "RETRY"
        if fields.get("bulk"):
            status = publish_bulk(
                [
                    {"entryId": "1", "event": "bulk text", "contentType": "text/plain"},
                    {"entryId": "2", "event": {"kind": "widget", "from": "bulk"},
                     "contentType": "application/json"},
                ]
            )
            if status != 204:
                return "ERROR" if batch == 1 else "RETRY"
        return "SUCCESS"

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
