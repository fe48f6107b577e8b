"""A publisher written from the Dapr Python SDK's documentation alone (`dapr` from PyPI,
unchanged; it knows nothing of cosmosq). Its `DaprClient` speaks Dapr's gRPC API at
DAPR_GRPC_PORT (after waiting on the HTTP health endpoint at DAPR_HTTP_PORT): it publishes one
event with `publish_event` (with a TTL), two with `publish_events`, sets an attribute and reads
the sidecar's metadata, then publishes to a topic it was not granted and calls a building block
the sidecar does not serve. Every call carries the caller's W3C trace context in its gRPC
metadata, put there by a client interceptor as OpenTelemetry's gRPC instrumentation does.

Usage: python dapr_grpc_client.py TOPIC TRACEPARENT
Prints one JSON line per step.
"""

import collections
import json
import sys

import grpc
from dapr.clients import DaprClient
from dapr.clients.exceptions import DaprGrpcError


def show(step, **fields):
    print(json.dumps({'step': step, **fields}), flush=True)


class _CallDetails(
    collections.namedtuple(
        '_CallDetails',
        ('method', 'timeout', 'metadata', 'credentials', 'wait_for_ready', 'compression'),
    ),
    grpc.ClientCallDetails,
):
    pass


class Traced(grpc.UnaryUnaryClientInterceptor):
    """Adds `traceparent` to every call's metadata."""

    def __init__(self, traceparent):
        self.traceparent = traceparent

    def intercept_unary_unary(self, continuation, details, request):
        metadata = list(details.metadata or []) + [('traceparent', self.traceparent)]
        return continuation(
            _CallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
                details.compression,
            ),
            request,
        )


def refused(call):
    try:
        call()
    except DaprGrpcError as error:
        return {
            'code': error.code().name,
            'reason': error.error_code(),
            'message': error.details(),
        }
    return None


def main():
    topic, traceparent = sys.argv[1], sys.argv[2]
    with DaprClient(interceptors=[Traced(traceparent)]) as client:
        client.publish_event(
            pubsub_name='pubsub',
            topic_name=topic,
            data=json.dumps({'from': 'python'}),
            data_content_type='application/json',
            publish_metadata={'ttlInSeconds': '3600'},
        )
        show('published')
        bulk = client.publish_events(
            pubsub_name='pubsub',
            topic_name=topic,
            data=[json.dumps({'from': 'python-bulk', 'n': n}) for n in (1, 2)],
            data_content_type='application/json',
        )
        show('published in bulk', failed=len(bulk.failed_entries))
        client.set_metadata('team', 'payments')
        metadata = client.get_metadata()
        show(
            'metadata',
            id=metadata.application_id,
            components=[
                {'name': c.name, 'type': c.type} for c in metadata.registered_components
            ],
            extended=metadata.extended_metadata,
        )
        show(
            'forbidden',
            error=refused(
                lambda: client.publish_event(pubsub_name='pubsub', topic_name='payments', data='x')
            ),
        )
        show(
            'state',
            error=refused(lambda: client.save_state(store_name='statestore', key='k', value='v')),
        )


if __name__ == '__main__':
    main()
