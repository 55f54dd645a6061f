"""What a request and a job are and how they are checked: the one schema, the flags, the job check,
the model's rules, the output rule, conditioning images, batching rules; imports neither http nor engine."""
