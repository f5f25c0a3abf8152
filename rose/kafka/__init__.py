"""The only place that talks to Kafka: thin confluent-kafka clients, transactions, topics."""
