"""A gRPC pub/sub app written from the Dapr Python SDK's documentation alone (`dapr-ext-grpc`
from PyPI, unchanged; it knows nothing of cosmosq): an `App` whose `@app.subscribe` handlers
take widgets (a routing rule) and everything else on the topic, answering with
`TopicEventResponse`: the first delivery of a "flaky" order `retry`, a "poison" one `drop`.
The sidecar calls its `AppCallback` service (`--app-protocol grpc`): `OnTopicEvent`, or
`OnBulkTopicEvent` for a bulk subscription, which the SDK hands to the same handlers.

Usage: python dapr_grpc_app.py APP_PORT TOPIC
Prints one JSON line per event received.
"""

import json
import sys
import threading

from cloudevents.sdk.event import v1
from dapr.clients.grpc._response import TopicEventResponse
from dapr.ext.grpc import App, Rule

APP_PORT, TOPIC = int(sys.argv[1]), sys.argv[2]

app = App()
printing = threading.Lock()
retried = set()


def show(**fields):
    with printing:
        print(json.dumps(fields), flush=True)


def answer(handler, event: v1.Event) -> TopicEventResponse:
    data = json.loads(event.Data())
    extensions = event.Extensions()
    show(
        step='received',
        handler=handler,
        id=event.EventID(),
        data=data,
        traceparent=extensions.get('traceparent'),
        # What the gRPC call's metadata said (the SDK prefixes it).
        metadata_traceparent=extensions.get('_metadata_traceparent'),
        # A bulk entry's own metadata (the SDK adds it to the event's extensions).
        tenant=extensions.get('tenant'),
    )
    if data.get('kind') == 'poison':
        return TopicEventResponse('drop')
    if data.get('kind') == 'flaky' and event.EventID() not in retried:
        retried.add(event.EventID())
        return TopicEventResponse('retry')
    return TopicEventResponse('success')


@app.subscribe(pubsub_name='pubsub', topic=TOPIC, rule=Rule('event.data.kind == "widget"', 1))
def widgets(event: v1.Event) -> TopicEventResponse:
    return answer('widgets', event)


# With routing rules, Dapr sends a message no rule matches nowhere: a last rule takes the rest.
@app.subscribe(pubsub_name='pubsub', topic=TOPIC, rule=Rule('true', 2))
def orders(event: v1.Event) -> TopicEventResponse:
    return answer('orders', event)


show(step='starting')
app.run(APP_PORT)
