package onceflow.spark;

import java.util.Map;

import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * Chunks of JSON-lines files read in the JVM: the landing folder's reader when Spark has
 * onceflow's jar (plugins/onceflow/sources/jvm.py). One option, {@code spec}: a JSON object with
 * {@code chunks} ([path, size, mtime, first_offset, byte_start, byte_end, partition] each, one
 * Spark task per chunk), {@code wanted} ([partition, start, end]: the offsets to keep),
 * {@code columns} ([name, type] pairs: decode each line by onceflow's rules, see
 * {@link LineDecoder}; null: each line is a {@code payload} string) and
 * {@code max_record_bytes} (null: no limit). The rows: partition, offset, then payload, or the
 * declared columns, {@code _corrupt_record} and {@code _problem}: what
 * onceflow.sources.landing's Python reader returns for the same chunks.
 */
public final class JsonLinesSource implements TableProvider, DataSourceRegister {
  @Override
  public String shortName() {
    return "onceflow-jsonl";
  }

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    return ReadSpec.parse(options.get("spec")).schema();
  }

  @Override
  public Table getTable(StructType schema, Transform[] partitioning, Map<String, String> properties) {
    return new JsonLinesTable(ReadSpec.parse(properties.get("spec")));
  }
}
