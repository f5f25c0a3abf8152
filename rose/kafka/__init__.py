"""The only place that imports confluent-kafka: thin clients, kept apart from what ROSE means by
its messages (that lives in rose.scheduler, rose.executor, rose.node).

- `base`: the configuration every client gets (pass-through librdkafka properties; librdkafka's
  log and errors as rate-limited ROSE log lines; one `kafka.unreachable` line when no broker
  answers);
- `admin`: the admin client, `wait_for_broker`, `partitions_of`, `retrying`;
- `producer`: `make_producer`, `produce`, `produce_event`, `dead_letter`, `partition_for`;
- `consumer`: `make_consumer`, `consume_batch`, `read_partitions`, `read_all`, `header`;
- `transactional`: consume-transform-produce in transactions (`Transactor`);
- `topics`: the contract's topics; `telemetry_publisher`: the agent's never-blocking producer.

Each module re-exports the confluent-kafka types its callers need (TopicPartition, Message,
KafkaException, …), so no other package imports confluent-kafka itself.
"""
