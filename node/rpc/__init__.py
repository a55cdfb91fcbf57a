"""gRPC plumbing shared by the node: server setup and the interceptor chain."""
