package onceflow.spark;

import java.util.Map;

import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * File segments read and decoded in the JVM: a file-segments source that declares
 * {@code json_schema} (onceflow.sources.segments). One option, {@code spec}: a JSON object
 * with {@code segments} ([path, partition] each, one Spark task per segment), {@code wanted}
 * ([partition, start, end]: the offsets to keep), {@code columns} ([name, type] pairs: each
 * payload decoded by onceflow's rules, see {@link LineDecoder}) and {@code max_record_bytes}.
 * The rows: partition, offset, the declared columns, {@code _corrupt_record} and
 * {@code _problem}: what the source's Python reader returns for the same ranges.
 */
public final class SegmentsSource implements TableProvider, DataSourceRegister {
  @Override
  public String shortName() {
    return "onceflow-segments";
  }

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    return SegmentsTable.parse(options.get("spec")).schema();
  }

  @Override
  public Table getTable(StructType schema, Transform[] partitioning,
                        Map<String, String> properties) {
    return SegmentsTable.parse(properties.get("spec"));
  }
}
