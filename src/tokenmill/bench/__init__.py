"""What `tokenmill bench` runs: request sets (`datasets`, `workloads`), the async load client against a server
(`serve`), the offline throughput run (`throughput`) and the tables and plots (`report`)."""
