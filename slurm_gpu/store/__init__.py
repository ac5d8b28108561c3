"""The node database: schema and migrations, writes, spool."""
