"""The official Python SDK (azure-cosmos) against a cosmosq emulator, as an app team would use it.

Usage: sdk_interop.py ENDPOINT KEY DATABASE QUEUE
Creates, reads, upserts, queries and deletes items in a container of its own, then writes three
messages into the queue's messages container with partition keys of three JSON types (a
string, a number, a boolean). Prints one JSON line per step; exits non-zero on the first failure.
"""
import json
import sys
import time

from azure.cosmos import CosmosClient, PartitionKey, exceptions


def step(name, **fields):
    print(json.dumps({"step": name, **fields}), flush=True)


def main():
    endpoint, key, database_name, queue = sys.argv[1:5]
    # What the SDK's emulator guides set: the well-known key, no endpoint discovery.
    client = CosmosClient(endpoint, credential=key, enable_endpoint_discovery=False)
    database = client.create_database_if_not_exists(database_name)
    step("database", id=database.id)

    scratch = database.create_container_if_not_exists(
        id="python-scratch", partition_key=PartitionKey(path="/tenant")
    )
    props = scratch.read()
    step("container", id=props["id"], pk=props["partitionKey"]["paths"])

    scratch.create_item({"id": "a", "tenant": "t1", "n": 1})
    scratch.upsert_item({"id": "b", "tenant": "t1", "n": 2})
    scratch.upsert_item({"id": "b", "tenant": "t1", "n": 3})
    read = scratch.read_item("b", partition_key="t1")
    assert read["n"] == 3, read
    step("read", id=read["id"], n=read["n"])

    rows = list(
        scratch.query_items(
            "SELECT c.id, c.n FROM c WHERE c.tenant = @t ORDER BY c.id",
            parameters=[{"name": "@t", "value": "t1"}],
            partition_key="t1",
        )
    )
    assert [r["id"] for r in rows] == ["a", "b"], rows
    cross = list(
        scratch.query_items("SELECT VALUE COUNT(1) FROM c", enable_cross_partition_query=True)
    )
    assert cross == [2], cross
    step("query", ids=[r["id"] for r in rows], count=cross[0])

    scratch.delete_item("a", partition_key="t1")
    try:
        scratch.read_item("a", partition_key="t1")
        raise AssertionError("a deleted item was read")
    except exceptions.CosmosResourceNotFoundError:
        pass
    step("delete", id="a")

    messages = database.get_container_client(queue)
    pk_path = messages.read()["partitionKey"]["paths"][0].lstrip("/")
    now = int(time.time() * 1000)
    for message_id, key_value in (("py-string", "customer-7"), ("py-number", 42), ("py-bool", True)):
        messages.create_item(
            {
                "id": message_id,
                pk_path: key_value,
                "body": {"from": "python", "key": key_value},
                "contentType": "application/json",
                "enqueuedAt": now,
            }
        )
    step("enqueued", ids=["py-string", "py-number", "py-bool"], pk=pk_path)


if __name__ == "__main__":
    main()
