"""Everything that talks to etcd: the backends of the v2 and v3 APIs, memory://, the HTTP
transport and the retry policies. Nothing above this folder speaks HTTP."""
